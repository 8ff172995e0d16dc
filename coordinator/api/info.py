"""``GetInfo``: who answers, who leads, the store and the coordinators seen (``ctl info``)."""

from __future__ import annotations

from importlib import metadata
from typing import Any

import grpc

from rankctl.proto import rankctl_pb2 as pb

try:
    VERSION = metadata.version("rankctl")
except metadata.PackageNotFoundError:  # pragma: no cover - a checkout run without installing
    VERSION = "0+unknown"


def coordinator_info(coord: Any) -> pb.GetInfoResponse:
    """``coord``: a ``server.CoordinatorServer``. Members come from the store's registrations (a replicated
    store; reading them may block briefly on etcd, so this runs on a worker thread) or are this one alone."""
    ha = coord.ha
    leading = coord.leading is not None
    out = pb.GetInfoResponse(id=coord.member_id, address=coord.address, role="leader" if leading else "standby",
                             version=VERSION)
    if ha is None:
        out.store_kind, out.store, out.leader_address = "sqlite", str(coord.settings.state_dir), coord.address
        held = coord.leading.core.held_reports if leading else 0
        if held:   # the store refuses writes (a full disk): what the nodes report waits in memory, retried
            out.store_problem = (f"the store refuses writes: {held} rank report(s) held in memory and retried every "
                                 "second (is its file system full? the coordinator's log says why: "
                                 "reports.store_failed)")
        out.members.append(pb.CoordinatorMember(id=coord.member_id, address=coord.address, version=VERSION,
                                                leading=True))
        return out
    out.store_kind, out.store, out.store_problem = "etcd", ha.store_url, ha.problem()
    leader = ha.leadership.leader or {}
    out.leader_address = leader.get("address", "")
    try:
        members = ha.leadership.members()
    except (grpc.RpcError, Exception):  # the store unreachable: this one alone, the problem says why
        members = [{"id": coord.member_id, "address": ha.leadership.me.address, "version": VERSION,
                    "started_at": ha.leadership.me.started_at}]
    for m in members:
        out.members.append(pb.CoordinatorMember(id=m.get("id", ""), address=m.get("address", ""),
                                                version=m.get("version", ""), started_at=m.get("started_at", 0.0),
                                                leading=m.get("id") == leader.get("id")))
    return out
