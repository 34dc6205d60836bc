"""Exceptions that services raise on purpose, and the gRPC status each maps to."""

from __future__ import annotations

import grpc


class KvmeshError(Exception):
    """Base class: an error the service means to report to its caller."""

    status_code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidRequestError(KvmeshError, ValueError):
    """The caller sent something the service cannot accept."""

    status_code = grpc.StatusCode.INVALID_ARGUMENT


class OverloadedError(KvmeshError):
    """A bounded queue is full; the caller should retry later (HTTP 429)."""

    status_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(KvmeshError):
    """A dependency is down (e.g. no worker); the caller sees HTTP 503."""

    status_code = grpc.StatusCode.UNAVAILABLE


def status_for_exception(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, KvmeshError):
        return exc.status_code
    if isinstance(exc, ValueError | TypeError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, KeyError):
        return grpc.StatusCode.NOT_FOUND
    return grpc.StatusCode.INTERNAL
