"""Requests that are not protobuf: INVALID_ARGUMENT naming the method, for every method of a server.

grpc.aio deserializes a request before any servicer code runs; a corrupt one raised DecodeError inside grpc,
which logged a traceback per call and answered UNKNOWN (INTERNAL where a servicer caught it). ``RequestGuard``
is the first interceptor of every rankctl server (coordinator, worker health and peer services): it swaps each
method's request deserializer for one that hands on a ``_Corrupt`` marker instead of raising, and the call is
refused with INVALID_ARGUMENT before the servicer sees it (unary requests) or when the servicer reads it
(streamed requests: ``MalformedRequest`` is raised to the servicer, which lets it through). It logs at most one
line per method per ``period_s``, with the number refused since, never a traceback.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable

import grpc
import structlog

log = structlog.get_logger("rankctl.security")


class MalformedRequest(Exception):
    """A request message on a stream is not the protobuf its method takes; its text names the method."""

    def __init__(self, method: str, problem: str) -> None:
        super().__init__(refusal(method, problem))
        self.problem = problem


@dataclass(frozen=True)
class _Corrupt:
    """What the tolerant deserializer returns for bytes that do not parse."""

    problem: str


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - DecodeError and whatever a deserializer raises on bad bytes
            return _Corrupt(str(exc) or type(exc).__name__)
    return parse


class _Checked:
    """A request stream that raises MalformedRequest at a corrupt message: a plain iterator, which a servicer may
    read from several tasks in turn (the node stream reads its Register in a ``wait_for`` task, the rest in a
    reader task)."""

    def __init__(self, stream: Any, method: str) -> None:
        self._stream, self._method = stream.__aiter__(), method

    def __aiter__(self) -> "_Checked":
        return self

    async def __anext__(self) -> Any:
        item = await self._stream.__anext__()
        if isinstance(item, _Corrupt):
            raise MalformedRequest(self._method, item.problem)
        return item


def refusal(method: str, problem: str) -> str:
    """The status detail of a refused call: the method and what the parser said."""
    return f"{method}: the request is not a valid protobuf message for this method: {problem}"[:500]


class RequestGuard(grpc.aio.ServerInterceptor):
    """Refuses undecodable requests with INVALID_ARGUMENT; put it first in a server's interceptors."""

    def __init__(self, period_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.period_s, self.clock = period_s, clock
        self._last: dict[str, float] = {}     # method -> when its last line was logged
        self._quiet: dict[str, int] = {}      # method -> refusals since then

    async def intercept_service(self, continuation, details):  # noqa: ANN001, ANN201 - grpc's signature
        handler = await continuation(details)
        return None if handler is None else self._wrap(handler, details.method)

    def note(self, method: str, problem: str) -> None:
        """One log line per method per period, counting the refusals it stood for."""
        now, count = self.clock(), self._quiet.get(method, 0) + 1
        last = self._last.get(method)
        if last is not None and now - last < self.period_s:
            self._quiet[method] = count
            return
        if len(self._last) > 1024:   # methods are a closed set on a real server; bound it all the same
            self._last.clear()
        self._last[method], self._quiet[method] = now, 0
        log.warning("rpc.malformed_request", method=method, refused=count, problem=problem[:200])

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        inner = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        streamed_in = handler.request_streaming
        # an async generator is iterated; a coroutine (unary, or streaming with context.write) awaited
        wrap = self._streaming if inspect.isasyncgenfunction(inner) else self._unary
        behaviour = wrap(inner, method, streamed_in)
        make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[(streamed_in, handler.response_streaming)]
        return make(behaviour, request_deserializer=_tolerant(handler.request_deserializer),
                    response_serializer=handler.response_serializer)

    async def _refuse(self, context: grpc.aio.ServicerContext, method: str, problem: str) -> None:
        self.note(method, problem)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal(method, problem))

    def _request(self, request: Any, method: str, streamed_in: bool) -> Any:
        """The request as the servicer gets it: a stream that raises MalformedRequest at a corrupt message."""
        return _Checked(request, method) if streamed_in else request

    def _unary(self, inner, method: str, streamed_in: bool):  # noqa: ANN001, ANN202
        async def call(request, context):  # noqa: ANN001, ANN202
            if isinstance(request, _Corrupt):
                await self._refuse(context, method, request.problem)
            try:
                return await inner(self._request(request, method, streamed_in), context)
            except MalformedRequest as exc:
                await self._refuse(context, method, exc.problem)
        return call

    def _streaming(self, inner, method: str, streamed_in: bool):  # noqa: ANN001, ANN202
        """A coroutine that writes what the servicer's generator yields. Not a generator around the generator:
        that cancelled node streams in a registration storm (bench/scale.py --nodes 2048: 35-102 of 2,048
        CANCELLED before Registered; none with this)."""
        async def call(request, context):  # noqa: ANN001, ANN202
            if isinstance(request, _Corrupt):
                await self._refuse(context, method, request.problem)
            try:
                async for item in inner(self._request(request, method, streamed_in), context):
                    await context.write(item)
            except MalformedRequest as exc:
                await self._refuse(context, method, exc.problem)
        return call
