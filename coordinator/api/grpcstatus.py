"""The status code of each domain failure the api answers with: one mapping for the servicers and the blob upload."""

from __future__ import annotations

import os

import grpc

from rankctl.coordinator.model.errors import DISK_IS_FULL, NOT_PERMITTED_TO_WRITE, os_problem

_CODES = {DISK_IS_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED, NOT_PERMITTED_TO_WRITE: grpc.StatusCode.FAILED_PRECONDITION}


def os_status(exc: OSError, where: str | os.PathLike[str] = "") -> tuple[grpc.StatusCode, str]:
    """The status code and message for an OSError a coordinator call hit (``model.errors.os_problem``): a full disk
    is RESOURCE_EXHAUSTED, a permission FAILED_PRECONDITION, anything else INTERNAL."""
    kind, message = os_problem(exc, where)
    return _CODES.get(kind, grpc.StatusCode.INTERNAL), message
