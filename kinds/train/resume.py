"""Which checkpoint step a resume or restart takes: the newest one every rank holds intact.

Every rank lists the steps its own markers say it finished with this run's fingerprint (in the checkpoint
root and the snapshot root; only its own job's files on a restart without ``train.resume``); one all-gather
over the world finds the newest step common to all. That step is then checked on every rank against the
SHA-256 and size its marker recorded (``contract.files.checkpoints.damage``) and, by the trainer, for tensors of this
layout's shapes (``kinds.train.intact``): a step some rank holds only damaged (torn, truncated, overwritten,
missing, rewritten with its marker) is passed over by every rank and the next older common step is
tried (one all-gather per step tried). Steps newer than the one taken that some rank holds damaged are
named too (a replacement node is sent only intact steps, so such a step is never common). Each passed-over
step is one line for the job's record (rank 0 puts them there: ``ctx.notice``). Checkpoints of another
identity are refused naming what differs (``refusal``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from rankctl.contract.files.checkpoints import damage
from rankctl.kinds.train import checkpoint as ckpt

Check = Callable[[str, int, int], str]   # (root, step, rank) -> why that shard cannot be restored ("": it can)


def _held(root: str, rank: int, fp: str, job_id: str | None) -> set[int]:
    """Steps of ``root`` this rank finished with fingerprint ``fp`` (and written by ``job_id``, if given)."""
    out = set()
    for step in ckpt.list_steps(root):
        m = ckpt.read_marker(root, step, rank)
        if m is not None and m.get("fingerprint") == fp and (job_id is None or m.get("job_id") == job_id):
            out.add(step)
    return out


def refusal(root: str, saved: dict[str, Any] | None, identity: dict[str, Any]) -> str:
    """One line: why the checkpoints under ``root`` cannot be resumed by this job."""
    diffs = ckpt.differences(saved, identity) if saved else []
    what = "; ".join(diffs) if diffs else "a different world size, layout, model, seed or data"
    hint = "resume with the same settings, or submit with train.resume: false to start afresh"
    if diffs and not any(d.startswith(("world_size", "parallel.")) for d in diffs):
        hint += " (another layout alone is resumed: the model, seed and data must match)"
    return f"cannot resume from {root}: its checkpoints were written by another run ({what}); {hint}"


def agree_resume_step(roots: str | Sequence[str], rank: int, world_size: int, identity: dict[str, Any], *,
                      restart: bool = False, job_id: str | None = None,
                      skipped: list[str] | None = None, held_by: list[str] | None = None,
                      check: Check = damage) -> int | None:
    """The latest step every rank has finished with this ``identity`` in any of ``roots`` (checkpoints,
    snapshots) and holds intact (``intact_root``: ``check``, the checksum by default; the trainer adds the tensor
    shapes, ``kinds.train.intact``), only files ``job_id`` wrote when it is given. A step some
    rank finds damaged is passed over by every rank (one line per step on ``skipped``, naming the step, the
    ranks and the first damage) and the next older common step is tried. None when there is no file at
    all, or (``restart``) when no step is held intact by every rank (a replacement node has none: the
    attempt starts over); RuntimeError naming what differs, or that every common step is damaged, otherwise.
    One world collective per step tried. ``held_by`` gets, when no step is common, one line naming what each
    group of ranks holds (why a restart starts over)."""
    roots = [roots] if isinstance(roots, str) else list(roots)
    fp = ckpt.fingerprint(identity)
    held: set[int] = set()
    marked: list[tuple[int, str]] = []  # (step, root) of every marker of this rank, any identity
    for root in roots:
        held |= _held(root, rank, fp, job_id)
        marked += [(s, root) for s in ckpt.complete_for(root, [rank])]
    newest = max(marked, default=None)
    saved = (ckpt.read_marker(newest[1], newest[0], rank) or {}).get("identity") if newest else None
    others = sorted({s for s, _ in marked} - held)[-HELD_SHOWN:]   # markers of another run, job or layout
    views = _everyone((sorted(held), bool(marked), saved, newest[1] if newest else roots[0], others), world_size)
    common = set.intersection(*(set(v[0]) for v in views))
    if not common and held_by is not None:
        held_by.append(holdings(views))
    damaged: list[str] = []
    while common:
        step = max(common)
        mine = "" if intact_root(roots, step, rank, fp, check) is not None else _damage(roots, step, rank, fp, check)
        found = [(r, why) for r, why in enumerate(_everyone(mine, world_size)) if why]
        if not found:
            break
        damaged.append(f"checkpoint step {step} is damaged on {rank_list([r for r, _ in found])} "
                       f"({found[0][1]}); passed over")
        common.discard(step)
    damaged += _newer_damage(roots, held, max(common) if common else None, rank, fp, world_size, damaged, check)
    if skipped is not None:
        skipped += damaged
    if common:
        return max(common)
    if damaged and not restart:
        raise RuntimeError(f"no intact checkpoint step to resume from: {'; '.join(damaged)}")
    if restart:
        return None
    if any(v[1] for v in views):
        saved, where = next(((v[2], v[3]) for v in views if v[2] is not None), (None, roots[0]))
        raise RuntimeError(refusal(where, saved, identity))
    return None


NEWER_CHECKED = 2   # steps newer than the one agreed on, checked on each rank for damage (to name it)
HELD_SHOWN = 2      # each rank's newest steps named when a restart starts over (``holdings``)


def _newer_damage(roots: Sequence[str], held: set[int], chosen: int | None, rank: int, fp: str, world_size: int,
                  named: list[str], check: Check = damage) -> list[str]:
    """Steps newer than ``chosen`` that some rank holds damaged (so no rank could take them: a replacement node
    is sent only intact steps), one line each, those ``named`` already left out. Each rank checks its newest
    ``NEWER_CHECKED`` such steps; one all-gather."""
    mine: dict[int, str] = {}
    for step in sorted((s for s in held if chosen is None or s > chosen), reverse=True)[:NEWER_CHECKED]:
        if intact_root(roots, step, rank, fp, check) is None:
            mine[step] = _damage(roots, step, rank, fp, check)
    found: dict[int, list[tuple[int, str]]] = {}
    for r, theirs in enumerate(_everyone(mine, world_size)):
        for step, why in (theirs or {}).items():
            found.setdefault(step, []).append((r, why))
    return [line for step in sorted(found, reverse=True)
            if not any(n.startswith(f"checkpoint step {step} ") for n in named)
            for line in [f"checkpoint step {step} is damaged on {rank_list([r for r, _ in found[step]])} "
                         f"({found[step][0][1]}); passed over"]]


def _everyone(mine: Any, world_size: int) -> list[Any]:
    """Every rank's ``mine``, in rank order (one all-gather; this rank's alone in a world of one)."""
    if world_size <= 1:
        return [mine]
    views: list[Any] = [None] * world_size
    dist.all_gather_object(views, mine)
    return views


def holdings(views: list[Any], shown: int = 4) -> str:
    """One line: the steps each group of ranks holds (ranks alike grouped, the ``shown`` largest groups)."""
    groups: dict[tuple, list[int]] = {}
    for r, v in enumerate(views):
        groups.setdefault((tuple(v[0][-HELD_SHOWN:]), tuple(v[4])), []).append(r)
    parts = []
    for (held, others), ranks in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))[:shown]:
        what = f"step{'s' if len(held) > 1 else ''} {', '.join(map(str, held))}" if held else "no step of this run"
        parts.append(f"{rank_list(ranks)} hold{'s' if len(ranks) == 1 else ''} {what}"
                     + (f" (and markers of another run or layout at {', '.join(map(str, others))})" if others else ""))
    more = f"; {len(groups) - shown} more group(s)" if len(groups) > shown else ""
    return "; ".join(parts) + more


def rank_list(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{f' and {len(ranks) - 8} more' if len(ranks) > 8 else ''}"


def _holding(roots: Sequence[str], step: int, rank: int, fp: str) -> list[str]:
    return [r for r in roots if (ckpt.read_marker(r, step, rank) or {}).get("fingerprint") == fp]


def intact_root(roots: Sequence[str], step: int, rank: int, fp: str, check: Check = damage) -> str | None:
    """The first of ``roots`` whose shard of (``step``, ``rank``) has ``fp`` and passes ``check`` (by default
    its marker's checksum; a checkpoint before a snapshot); None when none does."""
    return next((r for r in _holding(roots, step, rank, fp) if not check(r, step, rank)), None)


def _damage(roots: Sequence[str], step: int, rank: int, fp: str, check: Check = damage) -> str:
    whys = [check(r, step, rank) for r in _holding(roots, step, rank, fp)]
    return next((w for w in whys if w), f"rank {rank} holds no shard of step {step}")


def holding_root(roots: Sequence[str], step: int, rank: int, fp: str) -> str:
    """The first of ``roots`` whose marker of (``step``, ``rank``) has ``fp``: a checkpoint before a snapshot."""
    return _holding(roots, step, rank, fp)[0]
