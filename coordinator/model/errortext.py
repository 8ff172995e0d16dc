"""The one reader of a rank's error text: what its last line says happened (a full disk, a peer's failure, or its
own error). Rules over failures never read words again: they read the ``Fault`` built from this
(``coordinator.model.faults``)."""

from __future__ import annotations

import re
from enum import Enum

from rankctl.contract.files.diskspace import DISK_FULL


class ErrorText(str, Enum):
    OWN = "own"              # the rank's own error
    PEER = "peer"            # a peer's failure broke its collective (gloo, NCCL, torch.distributed): a victim
    DISK_FULL = "disk-full"  # its write found the file system full (ENOSPC, EDQUOT)


_PEER_FAILURE = re.compile(r"closed by peer|reset by peer|broken pipe|remote process exited|communicator was aborted|"
                           r"ncclRemoteError|DistNetworkError|DistBackendError|timed out", re.IGNORECASE)
_DISK_FULL = re.compile(rf"\[Errno ({'|'.join(map(str, DISK_FULL))})\]|No space left on device|Disk quota exceeded")


def last_error_line(error: str) -> str:
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    return lines[-1] if lines else "no error reported"


def read_error(line: str) -> ErrorText:
    """What a rank's last error line says: a full disk, a peer's failure, or its own error."""
    if _DISK_FULL.search(line):
        return ErrorText.DISK_FULL
    return ErrorText.PEER if _PEER_FAILURE.search(line) else ErrorText.OWN
