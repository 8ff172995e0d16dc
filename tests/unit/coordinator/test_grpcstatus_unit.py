"""Unit tests of coordinator.api.grpcstatus: the status code and message of an OSError a coordinator call hit."""

from __future__ import annotations

import errno
from pathlib import Path

import grpc
import pytest

from rankctl.coordinator.api.grpcstatus import os_status


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_is_resource_exhausted_naming_the_place_given(code: int) -> None:
    exc = OSError(code, "No space left on device", "/state/coordinator.db")
    status, message = os_status(exc, "/state")
    assert status is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert message == "the coordinator's disk under /state is full (No space left on device); nothing was stored"


def test_a_full_disk_without_a_place_names_the_file_of_the_error() -> None:
    status, message = os_status(OSError(errno.ENOSPC, "No space left on device", "/state/blob"))
    assert status is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "under /state/blob is full" in message


@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM, errno.EROFS])
def test_a_permission_is_failed_precondition_naming_the_file_before_the_place(code: int) -> None:
    exc = OSError(code, "Permission denied", "/state/jobs/x")
    status, message = os_status(exc, Path("/state"))
    assert status is grpc.StatusCode.FAILED_PRECONDITION
    assert message == "the coordinator may not write /state/jobs/x (Permission denied)"


def test_a_permission_without_a_file_names_the_place_given() -> None:
    status, message = os_status(OSError(errno.EACCES, "Permission denied"), Path("/state"))
    assert status is grpc.StatusCode.FAILED_PRECONDITION
    assert message == "the coordinator may not write /state (Permission denied)"


def test_any_other_os_error_is_internal_naming_the_path_and_the_cause() -> None:
    status, message = os_status(OSError(errno.EIO, "Input/output error", "/state/coordinator.db"))
    assert status is grpc.StatusCode.INTERNAL
    assert message == "the coordinator's filesystem failed at /state/coordinator.db (Input/output error)"


def test_an_error_with_no_errno_no_file_and_no_place_names_the_state_dir_and_its_type() -> None:
    status, message = os_status(FileNotFoundError())
    assert status is grpc.StatusCode.INTERNAL
    assert message == "the coordinator's filesystem failed at its state dir (FileNotFoundError)"
