"""Domain errors of the coordinator; the servicers map them to gRPC status codes (``coordinator.api.grpcstatus``)."""

from __future__ import annotations

import errno
import os

from rankctl.contract.files.diskspace import DISK_FULL


class CoordinatorError(Exception):
    """Base of the errors a client may see (their message is safe to show)."""


class JobNotFound(CoordinatorError):
    """No job has this id or name (NOT_FOUND)."""


class PoolNotFound(CoordinatorError):
    """No worker pool has this id (NOT_FOUND)."""


class AmbiguousJob(CoordinatorError):
    """Several jobs share the name given (INVALID_ARGUMENT)."""


class ProtocolError(CoordinatorError):
    """A node broke the session protocol, e.g. did not start with Register (FAILED_PRECONDITION)."""


class NodeNameTaken(CoordinatorError):
    """Another live daemon holds this node name (ALREADY_EXISTS)."""


class CapacityError(CoordinatorError):
    """The job can never fit the cluster's nodes (FAILED_PRECONDITION); nothing was stored."""


class InvalidRequest(CoordinatorError):
    """A request field the coordinator cannot use (INVALID_ARGUMENT)."""


NOT_PERMITTED = (errno.EACCES, errno.EPERM, errno.EROFS)
DISK_IS_FULL, NOT_PERMITTED_TO_WRITE, FILESYSTEM_FAILED = "disk-full", "not-permitted", "filesystem"


def os_problem(exc: OSError, where: str | os.PathLike[str] = "") -> tuple[str, str]:
    """What an OSError a coordinator call hit means, by its cause: a full disk (naming the disk under ``where``, the
    state dir or the file), a permission (naming the path), anything else (naming the path and the cause); the api
    maps each kind to its status code (``coordinator.api.grpcstatus``)."""
    path = str(where or exc.filename or "its state dir")
    cause = exc.strerror or type(exc).__name__
    if exc.errno in DISK_FULL:
        return DISK_IS_FULL, f"the coordinator's disk under {path} is full ({cause}); nothing was stored"
    path = str(exc.filename or where or "its state dir")
    if exc.errno in NOT_PERMITTED:
        return NOT_PERMITTED_TO_WRITE, f"the coordinator may not write {path} ({cause})"
    return FILESYSTEM_FAILED, f"the coordinator's filesystem failed at {path} ({cause})"
