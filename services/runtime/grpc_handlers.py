"""Rebuild a gRPC method handler around new behaviour, keeping its shape and (de)serializers.

Server interceptors that change what a method does (the error boundary, the
token check) must hand back a handler of the same kind (unary or streaming on
either side) or the server frames the call wrongly; this is the one place that
knows the four kinds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

# Turns a handler's behaviour (and its method's full name) into the new behaviour.
Rewrap = Callable[[Callable[..., Any], str], Callable[..., Any]]


def same_shape_handler(
    handler: grpc.RpcMethodHandler, method: str, unary: Rewrap, stream: Rewrap
) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour passed through ``unary`` (single response) or
    ``stream`` (streamed response)."""
    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary, method), **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream(handler.unary_stream, method), **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary, method), **kwargs)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(
            stream(handler.stream_stream, method), **kwargs
        )
    return handler
