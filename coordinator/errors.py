"""Domain errors of the coordinator; the servicers map them to gRPC status codes."""

from __future__ import annotations


class CoordinatorError(Exception):
    """Base of the errors a client may see (their message is safe to show)."""


class JobNotFound(CoordinatorError):
    """No job has this id or name (NOT_FOUND)."""


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
