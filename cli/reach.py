"""What listens at a coordinator address, asked over plain sockets when a gRPC channel does not come up: nothing
(refused: known at once), something silent, an HTTP server (the dashboard), or a gRPC server (then TLS is why)."""

from __future__ import annotations

import socket


def refused_now(address: str, timeout: float = 1.0) -> str:
    """Why ``address`` can be given up at once: "connection refused" (nothing listens: the kernel says so at once),
    "unknown host"; "" when it may yet answer (it accepts, or the connection only timed out)."""
    try:
        host, port = _host_port(address)
    except ValueError:
        return ""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return ""
    except ConnectionRefusedError:
        return "connection refused"
    except socket.gaierror:
        return "unknown host"
    except OSError:
        return ""


def _host_port(address: str) -> tuple[str, int]:
    """HOST:PORT (``[v6]:PORT``; an empty host is loopback); ValueError for ``unix:PATH`` and the like."""
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def listening(address: str, timeout: float = 2.0) -> bool:
    """Whether a TCP connection to ``address`` (HOST:PORT) is accepted."""
    try:
        with socket.create_connection(_host_port(address), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"   # + an empty SETTINGS


def answers(address: str, timeout: float = 2.0) -> bool:
    """Whether what listens at ``address`` answers an HTTP/2 client's first bytes at all: a gRPC server sends its
    SETTINGS, a TLS one an alert or a close; a stopped or hung process (the kernel still accepts) says nothing."""
    try:
        with socket.create_connection(_host_port(address), timeout=timeout) as sock:
            sock.sendall(H2_PREFACE)
            sock.recv(1)   # bytes or b"" (closed): an answer either way
            return True
    except socket.timeout:
        return False
    except (OSError, ValueError):
        return True   # reset or refused: something decided, not silence


HTTP_PROBE = b"HEAD / HTTP/1.0\r\n\r\n"


def speaks_http(address: str, timeout: float = 1.0) -> bool:
    """Whether what listens at ``address`` is an HTTP/1 server, not gRPC: it answers a plain HTTP request
    (``HTTP/1.x ...``), or it speaks TLS without offering HTTP/2 (ALPN ``h2``, which every gRPC server
    negotiates): the dashboard with or without TLS."""
    return _answers_http(address, timeout, tls=False) or _answers_http(address, timeout, tls=True)


def _answers_http(address: str, timeout: float, tls: bool) -> bool:
    try:
        with socket.create_connection(_host_port(address), timeout=timeout) as raw:
            raw.settimeout(timeout)
            if tls:
                with _probe_tls().wrap_socket(raw) as sock:  # completes before a server checks our certificate
                    return sock.selected_alpn_protocol() != "h2"
            raw.sendall(HTTP_PROBE)
            return raw.recv(8).startswith(b"HTTP/")
    except (OSError, ValueError):
        return False


def _probe_tls():  # noqa: ANN202 - an ssl.SSLContext
    """A context that only asks which protocol a TLS server offers (it verifies nothing and sends nothing)."""
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    return ctx
