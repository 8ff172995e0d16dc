"""Who may see the dashboard: the gRPC API's identities and roles, over HTTPS with client certificates.

With a TLS identity the dashboard serves HTTPS only and the TLS handshake requires a client certificate
signed by the cluster's CA; its subject is the viewer's identity (``security.certs.identity_of_pem``).
Each route reads what one ClientService method reads and needs that method's role (``auth.CLIENT_ROLES``:
pages need viewer); ``/metrics`` needs any certificate of the CA. Without TLS (a loopback-only
coordinator) every request is allowed, as on the gRPC side. The dashboard only reads.
"""

from __future__ import annotations

import ssl
from typing import Awaitable, Callable

from aiohttp import web

from rankctl.coordinator.api.auth import CLIENT_ROLES
from rankctl.security.certs import CertError, identity_of_pem
from rankctl.security.identity import ROLES, Identity, role_allows
from rankctl.security.tls import revoked_problem

WHO = web.RequestKey("who", Identity)  # the viewer of a request, set by the role check
ANY_CERT = "any"      # a route any certificate of the CA may read
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def peer_pem(request: web.Request) -> bytes | None:
    """The request's client certificate as PEM (None on plain HTTP)."""
    sslobj = request.transport.get_extra_info("ssl_object") if request.transport else None
    der = sslobj.getpeercert(binary_form=True) if sslobj is not None else None
    return ssl.DER_cert_to_PEM_cert(der).encode() if der else None


def peer(request: web.Request) -> Identity | None:
    """The identity of the request's client certificate (None on plain HTTP); CertError when it has none."""
    pem = peer_pem(request)
    return identity_of_pem(pem) if pem else None


def needs(method: str) -> str:
    """The role a route needs: that of the ClientService ``method`` it mirrors, or ANY_CERT."""
    return ANY_CERT if method == ANY_CERT else CLIENT_ROLES[method]


def refusal(who: Identity | None, need: str, what: str) -> str | None:
    if who is None:
        return "no client certificate"
    if need == ANY_CERT:
        return None
    if need in ROLES and (who.kind != "user" or not role_allows(who.role, need)):
        return f"{who} may not read {what}: it needs the {need} role"
    return None


def guarded(method: str, enabled: bool, handler: Handler, revocations: object = None) -> Handler:
    """``handler`` behind the role check of ``method`` (a no-op without TLS); the viewer in ``request[WHO]``.
    ``revocations`` (``security.revocation.Revocations``): a certificate on the CA's CRL is refused, 401."""
    need = needs(method)

    async def admit(request: web.Request) -> web.StreamResponse:
        who = None
        if enabled:
            try:
                who = peer(request)
            except CertError as exc:
                raise web.HTTPUnauthorized(text=f"not a rankctl identity: {exc}") from None
            revoked = revoked_problem(revocations, peer_pem(request), who)
            if revoked:
                raise web.HTTPUnauthorized(text=revoked)
            why = refusal(who, need, request.path)
            if why:
                raise web.HTTPForbidden(text=why)
        request[WHO] = who
        return await handler(request)

    return admit
