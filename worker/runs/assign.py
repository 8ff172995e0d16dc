"""Assign admission: a node's part of a job, from the coordinator's compact Assign to launched ranks.

The Assign names the node's rank range, the rendezvous and the spec (serialised once); each rank's
coordinates and groups are computed here (``RankLayout.rank_groups``: cost independent of the world
size), so that what crosses the network per node does not grow with the job. Ids, paths and the shipped
workdir are checked before any rank starts; a bad Assign is refused and its ranks reported never started.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from rankctl.contract.files import safepath
from rankctl.contract.assignment import RankAssignment
from rankctl.contract.limits import MAX_SLOTS_PER_NODE, MAX_WORLD_SIZE
from rankctl.kinds.registry import blob_limit_of, blobs_of
from rankctl.kinds.spec import parallel_config, parse_spec
from rankctl.parallel.layout import shared_layout
from rankctl.proto import rankctl_pb2 as pb
from rankctl.worker.runs import hangwatch
from rankctl.worker.files.blobs import FetchFailed, WorkdirCache
from rankctl.worker.daemon.config import DaemonConfig
from rankctl.worker.runs.hangwatch import HangWatch
from rankctl.worker.runs.launcher_client import LauncherError
from rankctl.worker.uplink.outbox import Outbox
from rankctl.worker.files.paths import Refused, check_assignment, run_dir_for
from rankctl.worker.runs.rankio import GENERATION_BYTES
from rankctl.worker.replication.replication import Replication
from rankctl.worker.uplink.reporting import exit_status, notice_status
from rankctl.worker.runs.runs import Runs
from rankctl.worker.runs.runstate import RunState
from rankctl.worker.files.sandbox import assignment_problem, written_problem
from rankctl.worker.runs.status import StatusTailer
from rankctl.worker.runs.supervisor import LauncherSupervisor


def claimed_ranks(msg: pb.Assign) -> list[int]:
    """The ranks an Assign gives this node, as far as they can be read (to report a refusal against)."""
    count = min(max(msg.rank_count, 0), MAX_SLOTS_PER_NODE)
    return [r for r in range(msg.first_rank, msg.first_rank + count) if r >= 0]


def expand(msg: pb.Assign, node: str, run_dir: str, gpus: int, address: str = "",
           roots: tuple[str, ...] = ()) -> list[RankAssignment]:
    """The node's rank assignments; raises ``Refused`` naming what is wrong with the Assign.

    ``address`` is the node's advertised address, where its ranks bind their collectives (``runtime.netif``);
    ``roots`` where they may create and delete (``worker.files.sandbox.write_roots``).
    """
    out = _compact(msg, node, gpus)
    for a in out:
        check_assignment(a, msg.job_id, msg.attempt)
    return [replace(a, run_dir=run_dir, node_address=address, roots=roots) for a in out]


def _compact(msg: pb.Assign, node: str, gpus: int) -> list[RankAssignment]:
    world, first, count = msg.world_size, msg.first_rank, msg.rank_count
    if not 1 <= world <= MAX_WORLD_SIZE:
        raise Refused(f"world_size={world} must be between 1 and {MAX_WORLD_SIZE}")
    if not 1 <= count <= MAX_SLOTS_PER_NODE or first < 0 or first + count > world:
        raise Refused(f"ranks {first}..{first + count - 1} (rank_count={count}) do not lie in a world of {world}")
    try:
        spec = parse_spec(json.loads(msg.spec_json))  # the daemon's one validation of the job's spec
        layout = shared_layout(parallel_config(spec))
    except Exception as exc:  # noqa: BLE001 - any defect of the spec refuses the Assign
        raise Refused(f"unreadable job spec: {str(exc)[:300]}") from None
    if layout.world_size != world:
        raise Refused(f"the spec's layout has {layout.world_size} ranks, the Assign says world_size={world}")
    return [RankAssignment(
        job_id=msg.job_id, attempt=msg.attempt, rank=rank, world_size=world, local_rank=rank - first, node=node,
        coords=layout.coords(rank), groups=layout.rank_groups(rank), rendezvous=msg.rendezvous,
        backend=msg.backend, kind=msg.kind, spec=spec, device=(rank - first) if gpus else None,
        restart=msg.restart,
    ) for rank in range(first, first + count)]


class Admission:
    """Admits the coordinator's Assign messages: a run of ``runs`` launched by ``launcher``, or a refusal.

    ``roots`` are where a job's node paths may lie (``worker.files.sandbox``), ``write_roots`` where its ranks may
    create files (``sandbox.write_roots``, as given and real); ``fetch_blob`` streams a shipped
    workdir from the coordinator into ``workdirs``.
    """

    def __init__(self, cfg: DaemonConfig, *, runs: Runs, launcher: LauncherSupervisor, replication: Replication,
                 workdirs: WorkdirCache, roots: list[str], write_roots: tuple[str, ...],
                 fetch_blob: Callable[[str], AsyncIterator[bytes]], outbox: Outbox, log: Any) -> None:
        self.cfg = cfg
        self._runs = runs
        self._launcher = launcher
        self._replication = replication
        self._workdirs = workdirs
        self._roots = roots
        self._write_roots = write_roots
        self._fetch_blob = fetch_blob
        self._outbox = outbox
        self._log = log
        self.refused = 0  # Assign messages refused

    async def admit(self, msg: pb.Assign) -> None:
        try:
            run_dir, assignments = self._expanded(msg)
            assignments = await self._with_workdir(assignments)
            self._check_paths(assignments, run_dir)
        except Refused as exc:
            self._refuse(msg, str(exc))
            return
        run = await self._new_run(msg, run_dir, assignments)
        self._runs.add(run)
        self._log.info("assigned", job=msg.job_id, attempt=msg.attempt, ranks=sorted(run.ranks))
        try:
            custom = self.cfg.log_cap_bytes != GENERATION_BYTES  # the launcher's default otherwise
            await self._launcher.launch(assignments, threads=self.cfg.rank_threads,
                                        **({"log_bytes": self.cfg.log_cap_bytes} if custom else {}))
        except LauncherError as exc:  # it just died: its death reports these ranks
            self._log.warning("launch failed", job=msg.job_id, error=str(exc))

    def _expanded(self, msg: pb.Assign) -> tuple[Path, list[RankAssignment]]:
        """The run dir and assignments of an Assign whose every id is safe as a path."""
        run_dir = run_dir_for(self.cfg.state_dir, msg.job_id, msg.attempt)
        gpus = len(self._launcher.hardware.get("gpus") or [])
        return run_dir, expand(msg, self.cfg.name, str(run_dir), gpus, self.cfg.advertise_address,
                               self._write_roots)

    async def _with_workdir(self, assignments: list[RankAssignment]) -> list[RankAssignment]:
        """Each rank's ``workdir``: this node's extracted copy of the job's shipped workdir, fetched once."""
        digests = blobs_of(assignments[0].spec) if assignments else []
        if not digests:
            return assignments
        try:
            path = await self._workdirs.path(digests[0], self._fetch_blob, blob_limit_of(assignments[0].spec),
                                             pin=True)  # unpinned when the run ends (or is refused)
        except (FetchFailed, OSError) as exc:
            raise Refused(f"cannot fetch the job's workdir {digests[0]}: {exc}") from None
        return [replace(a, workdir=str(path)) for a in assignments]

    def _check_paths(self, assignments: list[RankAssignment], run_dir: Path) -> None:
        """Refused when a node path of the spec lies outside the roots or the run dir cannot be made through no
        link below the state dir (the workdir it pinned is let go); the run dir is made last."""
        first = assignments[0] if assignments else None
        problem = first and (assignment_problem(first.spec, self._roots, workdir=first.workdir)
                             or written_problem(first.spec, self._write_roots) or self._run_dir_problem(run_dir))
        if problem:
            for digest in blobs_of(first.spec)[:1] if first.workdir else []:
                self._workdirs.unpin(digest)
            raise Refused(problem)

    def _run_dir_problem(self, run_dir: Path) -> str | None:
        """The run dir made through no link below the state dir (made when new: trusted as given), or why not."""
        state = os.path.realpath(self.cfg.state_dir)   # run_dir is a real path too (``paths.run_dir_for``)
        try:
            os.makedirs(state, exist_ok=True)
            safepath.makedirs(state, str(run_dir))
        except OSError as exc:
            return f"cannot make the run dir {run_dir}: {exc.strerror or exc}"
        return None

    async def _new_run(self, msg: pb.Assign, run_dir: Path, assignments: list[RankAssignment]) -> RunState:
        """The run of admitted ``assignments`` (its directory made by ``_check_paths``), a replaced node's
        checkpoints fetched."""
        ranks = {a.rank for a in assignments}
        spec = assignments[0].spec if assignments else None
        name = spec.name if spec else ""
        if name:
            self._replication.revive(name)
        if msg.restore_peer and name:
            for line in await self._replication.restore(msg.restore_peer, name, sorted(ranks), msg.job_id):
                self._outbox.report(msg.job_id, msg.attempt, notice_status(min(ranks), self.cfg.name, line))
        workdir = (blobs_of(spec)[:1] or [""])[0] if spec and assignments[0].workdir else ""
        return RunState(job_id=msg.job_id, attempt=msg.attempt, run_dir=str(run_dir), ranks=ranks,
                        alive=set(ranks),  # counted alive from the launch on; exits remove them
                        tailer=StatusTailer(str(run_dir)), job_name=name, replica_peer=msg.replica_peer,
                        hangs=HangWatch(hangwatch.stall_cap(spec.restart.hang_timeout if spec else None)),
                        workdir_blob=workdir)

    def _refuse(self, msg: pb.Assign, why: str) -> None:
        """Count and log a refused Assign; its ranks are reported as never started."""
        self.refused += 1
        self._log.error("assignment refused", job=msg.job_id[:80], attempt=msg.attempt, error=why,
                        refused=self.refused)
        for rank in claimed_ranks(msg):
            self._outbox.report(msg.job_id, msg.attempt, exit_status(
                rank, self.cfg.name, 1, f"node {self.cfg.name} refused the assignment: {why}"))
