"""Who may call what: the coordinator's authorization, one server interceptor.

With ``--tls-dir`` the coordinator serves mutual TLS only, so every call arrives with a client
certificate signed by the cluster's CA; its subject names the caller (``rankctl.security``:
CN = name, OU = role). Each method needs a role:

* ``rankctl.v1.NodeService``: a *node* certificate (and ``Register`` only under the certificate's
  own name: checked by the node servicer with ``caller()``);
* ``rankctl.v1.ClientService``: users only (viewer < submitter < admin); reads need viewer, submit,
  uploads and cancel need submitter (cancelling another user's job needs admin: checked by the
  servicer), drain needs admin; a method not listed needs admin;
* health (and anything outside rankctl's services): any certificate of the CA.

A refused call ends with PERMISSION_DENIED (or UNAUTHENTICATED for a certificate without a
rankctl identity) naming the caller, the method and the role it lacks. Mutating calls are logged
with the caller. The caller of the call being served is in ``caller()`` (a context variable set
around the handler). Without TLS (loopback only, see ``cli.commands.daemons``) every call is allowed and
``caller()`` is None.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable

import grpc
import structlog

from rankctl.security.identity import NODE, ROLES, Identity, role_allows
from rankctl.security.tls import peer_pem, revoked_problem

log = structlog.get_logger("rankctl.coordinator")
_CALLER: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("rankctl_caller", default=None)
_CERT: contextvars.ContextVar[tuple[Any, bytes] | None] = contextvars.ContextVar("rankctl_cert", default=None)

CLIENT = "/rankctl.v1.ClientService/"
NODES = "/rankctl.v1.NodeService/"
VIEWER, SUBMITTER, ADMIN = ROLES
CLIENT_ROLES = {
    "GetJob": VIEWER, "ListJobs": VIEWER, "ListNodes": VIEWER, "WatchJob": VIEWER, "WatchJobBatches": VIEWER,
    "GetLogs": VIEWER, "PlanJob": VIEWER, "StatBlob": VIEWER, "GetJobSchema": VIEWER,
    "SubmitJob": SUBMITTER, "UploadBlob": SUBMITTER, "CancelJob": SUBMITTER,
    "DrainNode": ADMIN, "StartWorkers": ADMIN, "ReleaseWorkers": ADMIN, "ListWorkerPools": VIEWER,
    "GetInfo": VIEWER,
}
MUTATING = {"SubmitJob", "UploadBlob", "CancelJob", "DrainNode", "StartWorkers", "ReleaseWorkers"}


def caller() -> Identity | None:
    """The identity of the call being served (None without TLS)."""
    return _CALLER.get()


def caller_certificate() -> tuple[Any, bytes] | None:
    """For the call being served: (the revocation list it was checked against, the caller's certificate PEM), so
    that a long node stream can be closed when its certificate is revoked later; None without a list."""
    return _CERT.get()


def needed(method: str) -> str | None:
    """The role ``method`` (``/package.Service/Method``) needs: a user role, ``NODE``, or None (any)."""
    if method.startswith(NODES):
        return NODE
    if method.startswith(CLIENT):
        return CLIENT_ROLES.get(method[len(CLIENT):], ADMIN)
    return None


def refusal(who: Identity, method: str, need: str) -> str | None:
    """Why ``who`` may not call ``method`` (None: it may)."""
    name = method.rsplit("/", 1)[-1]
    if need == NODE:
        return None if who.kind == NODE else f"{who} may not call {name}: only node certificates open node streams"
    if need in ROLES and (who.kind != "user" or not role_allows(who.role, need)):
        return f"{who} may not call {name}: it needs the {need} role"
    return None


class Authorizer(grpc.aio.ServerInterceptor):
    """Checks each call's certificate against ``needed``; ``identify(context)`` -> Identity (raises
    ValueError for a certificate without a rankctl identity), used only when ``enabled``. ``revocations``
    (``security.revocation.Revocations``): certificates on the CA's CRL are refused, UNAUTHENTICATED."""

    def __init__(self, identify: Callable[[Any], Identity | None], enabled: bool, revocations: Any = None) -> None:
        self.identify, self.enabled, self.revocations = identify, enabled, revocations

    async def intercept_service(self, continuation, details):  # noqa: ANN001, ANN201 - grpc's signature
        handler = await continuation(details)
        if handler is None or not self.enabled:
            return handler
        return _wrap(handler, details.method, self._admit)

    async def _admit(self, context: grpc.aio.ServicerContext, method: str) -> Identity:
        try:
            who = self.identify(context)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"not a rankctl identity: {exc}")
        if who is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no client certificate")
        pem = peer_pem(context)
        revoked = revoked_problem(self.revocations, pem, who)
        if revoked:
            log.warning("call refused: certificate revoked", caller=str(who), method=method)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, revoked)
        if self.revocations is not None:
            _CERT.set((self.revocations, pem))
        need = needed(method)
        why = refusal(who, method, need) if need else None
        if why:
            log.warning("call refused", caller=str(who), method=method)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        if method.rsplit("/", 1)[-1] in MUTATING:
            log.info("call", caller=str(who), method=method)
        return who


def _wrap(handler: grpc.RpcMethodHandler, method: str, admit) -> grpc.RpcMethodHandler:  # noqa: ANN001
    """The same handler, admitting the caller first and serving with ``caller()`` set."""
    if handler.unary_unary or handler.stream_unary:
        inner = handler.unary_unary or handler.stream_unary

        async def unary(request, context):  # noqa: ANN001, ANN202
            token = _CALLER.set(await admit(context, method))
            try:
                return await inner(request, context)
            finally:
                _CALLER.reset(token)

        make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
        return make(unary, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
    inner = handler.unary_stream or handler.stream_stream

    async def streaming(request, context):  # noqa: ANN001, ANN202
        token = _CALLER.set(await admit(context, method))
        try:
            async for item in inner(request, context):
                yield item
        finally:
            _CALLER.reset(token)

    make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
    return make(streaming, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
