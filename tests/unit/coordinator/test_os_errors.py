"""Every gRPC method answers an OSError by its cause, never INTERNAL "internal error (OSError)" (issue 24): the
servicer's one mapping (``domain_status``) sends it through ``coordinator.api.grpcstatus.os_status``."""

import errno

import grpc
import pytest

from rankctl.coordinator.api.servicer import domain_status


@pytest.mark.parametrize("code, status, words", [
    (errno.ENOSPC, grpc.StatusCode.RESOURCE_EXHAUSTED, "is full"),
    (errno.EDQUOT, grpc.StatusCode.RESOURCE_EXHAUSTED, "is full"),
    (errno.EACCES, grpc.StatusCode.FAILED_PRECONDITION, "may not write"),
    (errno.EIO, grpc.StatusCode.INTERNAL, "filesystem failed"),
])
def test_an_os_error_is_answered_by_its_cause_and_names_the_path(code: int, status: grpc.StatusCode,
                                                                  words: str) -> None:
    exc = OSError(code, "cause", "/var/lib/rankctl/state.db")
    got, message = domain_status(exc)
    assert got == status and words in message and "/var/lib/rankctl/state.db" in message, message


def test_other_errors_are_not_domain_errors() -> None:
    assert domain_status(RuntimeError("x")) is None
