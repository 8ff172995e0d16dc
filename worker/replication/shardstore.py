"""A node's checkpoint and snapshot steps on disk and in memory, its own ranks' and the copies it keeps for peers
(``worker.replication.replicas`` moves them between nodes): which step a restore takes, what is pruned, what a finished run
frees. Every file is created, renamed and deleted through no symbolic link below ``base(area)`` (the state dir or
the snapshot memory: ``contract.files.safepath``), since the job name is a user's value. Pure file work: call it off the
event loop."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterable

from rankctl.contract.files import checkpoints as layout
from rankctl.contract.files import safepath

KEEP_STEPS = layout.KEEP_STEPS
SNAPSHOTS = "snapshots"
AREAS = (SNAPSHOTS, "")  # the wire's ``root``; snapshots first, the newer state of the two


class ShardStore:
    """This node's complete checkpoint and snapshot steps (``area``: ``""`` or ``"snapshots"``): its own
    ranks' and the copies it keeps for peers."""

    def __init__(self, state_dir: Path | str) -> None:
        self.state_dir = str(state_dir)

    def base(self, area: str = "") -> str:
        """Where the no-link walk to ``area``'s roots starts: the node's snapshot memory or its state dir (trusted
        as given; made when missing)."""
        base = layout.memory_base(self.state_dir) if area == SNAPSHOTS else self.state_dir
        os.makedirs(base, mode=0o700, exist_ok=True)
        return base

    def own_root(self, name: str, area: str = "") -> str:
        if area == SNAPSHOTS:
            return layout.snapshot_root(self.state_dir, name)
        return layout.root_in(self.state_dir, name)

    def replica_root(self, name: str, area: str = "") -> str:
        if area == SNAPSHOTS:
            return layout.snapshot_replica_root(self.state_dir, name)
        return os.path.join(self.state_dir, "replicas", name)

    def newest(self, name: str, ranks: list[int], area: str = "", job_id: str = "",
               passed: list[str] | None = None) -> tuple[int, dict[int, str]] | None:
        """The newest step complete and intact for every rank in either root (each shard matches the checksum
        its marker recorded: ``contract.files.checkpoints.damage``; a damaged step is passed over for an older one, one
        line on ``passed`` naming the step, the rank and the damage), and the root of each rank's files.
        ``job_id``: only steps whose markers name that job (a restart's: an earlier job of the same name may
        have left newer steps of these ranks here). Reads the shards it checks: call it off the event loop."""
        roots = (self.own_root(name, area), self.replica_root(name, area))
        steps = set()
        for root in roots:
            steps.update(layout.list_steps(root))

        def why_not(rt: str, step: int, r: int) -> str | None:
            """None: usable; "": not held (no marker of the job); else the damage."""
            marker = layout.read_marker(rt, step, r)
            if marker is None or (job_id and marker.get("job_id") != job_id):
                return ""
            return layout.damage(rt, step, r) or None

        for step in sorted(steps, reverse=True):
            where: dict[int, str] = {}
            for r in ranks:
                whys = [why_not(rt, step, r) for rt in roots]
                if None not in whys:
                    if (damage := next((w for w in whys if w), "")) and passed is not None:
                        passed.append(f"{'snapshot' if area == SNAPSHOTS else 'checkpoint'} step {step} of rank {r} "
                                      f"is damaged ({damage}); passed over")
                    break
                where[r] = roots[whys.index(None)]
            else:
                return step, where
        return None

    def _tombstone(self, name: str) -> str:
        return self.replica_root(name, SNAPSHOTS) + ".dropped"

    def dropped(self, name: str) -> bool:
        """This node dropped ``name``'s snapshots (its run ended) and no run of the name started here since:
        a peer's late push of them is refused, or it would stay in memory."""
        return os.path.exists(self._tombstone(name))

    def revive(self, name: str) -> None:
        """A run of ``name`` starts here: snapshot pushes for it are welcome again."""
        with contextlib.suppress(OSError):
            safepath.unlink(self.base(SNAPSHOTS), self._tombstone(name))

    def drop_snapshots(self, name: str, ranks: Iterable[int]) -> int:
        """A run of ``name`` ended with every rank of this node done: its snapshots served only its restarts.
        Removes ``ranks``' own snapshot files and every copy kept for peers under the name (and refuses
        later pushes of them until the name runs here again: ``revive``); files removed."""
        own, kept, base = self.own_root(name, SNAPSHOTS), self.replica_root(name, SNAPSHOTS), self.base(SNAPSHOTS)
        with contextlib.suppress(OSError):
            os.close(safepath.open_write(base, self._tombstone(name), create_dirs=True))
        removed = _remove_ranks(base, own, ranks) + _remove_ranks(base, kept, layout.ranks_in(kept))
        for root in (own, kept):
            with contextlib.suppress(OSError):
                safepath.rmdir(base, root)   # only when empty (another run of the name may still write)
        return removed

    def prune(self, name: str, area: str = "", arrived: dict[int, int] | None = None) -> None:
        """Keep the newest KEEP_STEPS steps of each rank among the copies kept for peers; a rank's
        step that just ``arrived`` (rank -> step) first drops that rank's newer steps."""
        root, base = self.replica_root(name, area), self.base(area)
        for rank, step in (arrived or {}).items():
            for newer in layout.list_steps(root):
                if newer > step:
                    layout.remove_rank_step(root, newer, rank, base=base)
        layout.prune(root, keep=KEEP_STEPS, base=base)


def _remove_ranks(base: str, root: str, ranks: Iterable[int]) -> int:
    """Every step's files of ``ranks`` under ``root`` (through no link below ``base``); how many files went."""
    before = _files(root)
    for rank in ranks:
        for step in layout.list_steps(root):
            layout.remove_rank_step(root, step, rank, base=base)
    return before - _files(root)


def _files(root: str) -> int:
    return sum(len(files) for _, _, files in os.walk(root))
