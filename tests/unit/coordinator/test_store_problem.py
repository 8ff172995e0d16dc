"""What a standby's refusals and `ctl info` say when etcd fails a call: one line naming etcd's answer. While the warm
copy loaded, a gRPC error went out as its Python repr (`<_InactiveRpcError of RPC that terminated with: ...`,
several lines, debug_error_string included): an outside probe with etcd's quorum lost."""

from __future__ import annotations

import grpc
from grpc._channel import _InactiveRpcError, _RPCState

from rankctl.coordinator.ha.etcd import Unreachable
from rankctl.coordinator.ha.leadership import store_problem


def test_an_etcd_error_is_one_line_naming_its_code_and_details() -> None:
    exc = _InactiveRpcError(_RPCState((), None, None, grpc.StatusCode.UNKNOWN, "context deadline exceeded"))
    assert "_InactiveRpcError" in str(exc) or "\n" in str(exc)          # what was shown before
    assert store_problem(exc) == "etcd answered UNKNOWN: context deadline exceeded"
    assert store_problem(Unreachable("127.0.0.1:2379: Deadline Exceeded")) == "127.0.0.1:2379: Deadline Exceeded"
