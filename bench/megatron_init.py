"""Megatron-Core parallel-state initialisation per rank: rankctl.megatron vs Megatron's own.

Side by side in one run, for one rank:
* megatron-core ``parallel_state.initialize_model_parallel`` (every rank creates every group);
* rankctl: layout + ``ProcessGroups.build`` (own groups only) + ``rankctl.megatron.initialize_model_parallel``.
Live: 8 gloo ranks forked from this process, both paths in the same ranks, alternating
(time = slowest rank, median over rounds, each round a fresh job). Large worlds: ``torch.distributed`` mocked (a fake
``new_group`` that counts and returns a token; ``get_rank``/``get_world_size`` patched), so the
figures are the Python cost and the ``new_group`` count, not communicator set-up.

    python bench/megatron_init.py [--world-sizes 1024,8192,65536] [--repeat 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks are forked from this process
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")  # no Transformer Engine / Apex

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from ranks import fork_ranks  # noqa: E402

from rankctl.megatron import GroupsContext, initialize_model_parallel  # noqa: E402
from rankctl.megatron.version import installed_version  # noqa: E402
from rankctl.parallel.groups import ProcessGroups  # noqa: E402
from rankctl.parallel.layout import ParallelConfig, RankLayout  # noqa: E402

torch.set_num_threads(1)
LIVE = dict(world_size=8, tp=2, pp=2)
LARGE = dict(tp=8, cp=2, pp=8, ep=8)


def megatron_init(cfg: ParallelConfig) -> None:
    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=cfg.vpp, context_parallel_size=cfg.cp,
        expert_model_parallel_size=cfg.ep, expert_tensor_parallel_size=cfg.etp, order=cfg.order,
    )


def rankctl_init(rank: int, kw: dict) -> GroupsContext:
    """What a rankctl rank runs: its layout, its own groups, Megatron's state from them."""
    layout = RankLayout(ParallelConfig(**kw))
    ctx = GroupsContext(ProcessGroups.build(rank, layout.world_size, layout.rank_groups(rank)), layout)
    initialize_model_parallel(ctx)
    return ctx


@contextmanager
def counted_new_group(fake: bool) -> Iterator[list[int]]:
    """Count ``new_group`` calls; with ``fake``, return a token instead of a communicator."""
    calls: list[int] = []
    real = dist.new_group

    def new_group(ranks: Any = None, **_: Any) -> Any:
        calls.append(1)
        return object() if fake else real(ranks, **_)

    dist.new_group = new_group
    try:
        yield calls
    finally:
        dist.new_group = real


def timed(fn: Callable[[], Any], fake: bool) -> tuple[float, int, Any]:
    with counted_new_group(fake) as calls:
        t0 = time.perf_counter()
        out = fn()
        elapsed = time.perf_counter() - t0
    return elapsed, len(calls), out


# -- large worlds, mocked torch.distributed -----------------------------------------------------
@contextmanager
def mocked_world(rank: int, world: int) -> Iterator[None]:
    """``torch.distributed`` as one rank of ``world`` sees it, without a process group."""
    saved = {n: getattr(dist, n) for n in ("get_rank", "get_world_size", "is_initialized")}
    dist.get_rank = lambda group=None: rank
    dist.get_world_size = lambda group=None: world
    dist.is_initialized = lambda: True
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def best(repeat: int, fn: Callable[[], tuple[float, int, Any]]) -> tuple[float, int]:
    runs = [fn() for _ in range(repeat)]
    return min(t for t, _, _ in runs), runs[0][1]


def mocked_row(world: int, repeat: int) -> dict:
    kw = {**(LIVE if world == 8 else LARGE), "world_size": world}
    cfg, rank = ParallelConfig(**kw), world // 2 + 3 if world > 8 else 5

    def theirs() -> tuple[float, int, Any]:
        out = timed(lambda: megatron_init(cfg), fake=True)
        ps.destroy_model_parallel()
        return out

    def ours() -> tuple[float, int, Any]:
        out = timed(lambda: rankctl_init(rank, kw), fake=True)
        ps.destroy_model_parallel()
        return out

    with mocked_world(rank, world):
        (t_meg, n_meg), (t_ours, n_ours) = best(repeat, theirs), best(repeat, ours)
    return dict(kind="mocked", kw=kw, t_meg=t_meg, n_meg=n_meg, t_ours=t_ours, n_ours=n_ours)


# -- 8 live gloo ranks -----------------------------------------------------------------------------
def live_rank(rank: int, world: int, store: str, out: str, kw: dict) -> None:
    """Both paths in one fresh world (groups are named by members: a world builds them once)."""
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    dist.barrier()
    t_meg, n_meg, _ = timed(lambda: megatron_init(ParallelConfig(**kw)), fake=False)
    ps.destroy_model_parallel()
    dist.barrier()
    t_ours, n_ours, ctx = timed(lambda: rankctl_init(rank, kw), fake=False)
    ps.destroy_model_parallel()
    ctx.destroy()
    dist.barrier()
    dist.destroy_process_group()
    Path(out, f"{rank}.json").write_text(json.dumps([t_meg, n_meg, t_ours, n_ours]))


def live_round(world: int) -> list[float]:
    """One job of ``world`` forked ranks; the slowest rank's figures."""
    with tempfile.TemporaryDirectory(prefix="rankctl-bench-megatron-") as tmp:
        codes = fork_ranks(world, live_rank, str(Path(tmp, "store")), tmp, LIVE)
        if codes != [0] * world:
            raise SystemExit(f"live ranks failed: exit codes {codes}")
        per_rank = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(world)]
    return [max(col) for col in zip(*per_rank)]


def live_row(rounds: int) -> dict:
    runs = [live_round(LIVE["world_size"]) for _ in range(rounds)]
    t_meg, n_meg, t_ours, n_ours = (statistics.median(col) for col in zip(*runs))
    return dict(kind="live gloo", kw=LIVE, t_meg=t_meg, n_meg=int(n_meg), t_ours=t_ours, n_ours=int(n_ours))


def print_table(rows: list[dict], repeat: int, rounds: int) -> None:
    print(f"parallel-state init per rank: megatron-core {installed_version()} initialize_model_parallel"
          " vs rankctl (layout + own groups + rankctl.megatron.initialize_model_parallel)")
    print(f"(live: slowest rank, median of {rounds} rounds; mocked: one rank, best of {repeat})")
    head = (f"{'world':>7} {'how':<10} {'layout':<22} {'megatron ms':>12} {'rankctl ms':>11} {'x':>7}"
            f" {'megatron new_group':>19} {'rankctl new_group':>18} {'x':>7}")
    print(head)
    for r in rows:
        kw = r["kw"]
        layout = " ".join(f"{k}{v}" for k, v in kw.items() if k != "world_size" and v != 1)
        t_meg, t_ours, n_meg, n_ours = r["t_meg"] * 1e3, r["t_ours"] * 1e3, r["n_meg"], r["n_ours"]
        print(f"{kw['world_size']:>7} {r['kind']:<10} {layout:<22} {t_meg:>12.1f} {t_ours:>11.2f}"
              f" {t_meg / t_ours:>6.1f}x {n_meg:>19,} {n_ours:>18,} {n_meg / n_ours:>6.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--world-sizes", default="1024,8192,65536")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ns = ap.parse_args()
    rows = [live_row(ns.rounds), mocked_row(8, ns.repeat)]
    rows += [mocked_row(int(w), ns.repeat) for w in ns.world_sizes.split(",")]
    print_table(rows, ns.repeat, ns.rounds)


if __name__ == "__main__":
    main()
