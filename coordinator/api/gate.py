"""What a coordinator that does not lead answers: UNAVAILABLE, saying who leads.

Every rankctl call but ``GetInfo`` passes ``LeaderGate``. While the coordinator leads (always, on the embedded
store) the call goes through; a standby refuses it with UNAVAILABLE, a message naming the leader (or why none
leads: the store unreachable, an election under way) and the leader's address in the trailing metadata
``rankctl-leader``, which ``ctl`` and the worker daemons follow. Health and reflection always answer.
"""

from __future__ import annotations

from typing import Callable

import grpc

from rankctl.proto import LEADER_METADATA

ANSWERED_BY_ANY = ("/rankctl.v1.ClientService/GetInfo",)


class LeaderGate(grpc.aio.ServerInterceptor):
    """``refusal()`` -> None while leading, else (message, leader address or "")."""

    def __init__(self, refusal: Callable[[], tuple[str, str] | None]) -> None:
        self.refusal = refusal

    async def intercept_service(self, continuation, details):  # noqa: ANN001, ANN201 - grpc's signature
        handler = await continuation(details)
        if handler is None or not details.method.startswith("/rankctl.v1.") or details.method in ANSWERED_BY_ANY:
            return handler
        return _gated(handler, self.refusal)


async def _refuse(context: grpc.aio.ServicerContext, why: tuple[str, str]) -> None:
    message, leader = why
    context.set_trailing_metadata(((LEADER_METADATA, leader),))
    await context.abort(grpc.StatusCode.UNAVAILABLE, message)


def _gated(handler: grpc.RpcMethodHandler, refusal: Callable[[], tuple[str, str] | None]) -> grpc.RpcMethodHandler:
    if handler.unary_unary or handler.stream_unary:
        inner = handler.unary_unary or handler.stream_unary

        async def unary(request, context):  # noqa: ANN001, ANN202
            why = refusal()
            if why is not None:
                await _refuse(context, why)
            return await inner(request, context)

        make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
        return make(unary, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
    inner = handler.unary_stream or handler.stream_stream

    async def streaming(request, context):  # noqa: ANN001, ANN202
        why = refusal()
        if why is not None:
            await _refuse(context, why)
        async for item in inner(request, context):
            yield item

    make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
    return make(streaming, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
