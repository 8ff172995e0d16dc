"""Layout speed at scale, side by side in one process.

65,536 ranks (tp=8, cp=2, pp=8, ep=8): megatron-core's RankGenerator for all kinds
(what every Megatron rank runs at start-up) vs rankctl's RankLayout for all kinds vs
``rank_groups`` for one rank (what a rankctl rank needs). Prints times and ratios.

    python bench/layout.py [--world-size N] [--repeat R]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from rankctl.parallel.layout import GROUP_NAMES, ParallelConfig, RankLayout  # noqa: E402


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--world-size", type=int, default=65536)
    ap.add_argument("--repeat", type=int, default=3)
    ns = ap.parse_args()
    kw = dict(world_size=ns.world_size, tp=8, cp=2, pp=8, ep=8)
    from megatron_ref import megatron_groups  # imports megatron-core (dev extra)

    t_meg = best_of(ns.repeat, lambda: megatron_groups(**kw))
    t_all = best_of(ns.repeat, lambda: [RankLayout(ParallelConfig(**kw)).group_array(k) for k in GROUP_NAMES])
    lay = RankLayout(ParallelConfig(**kw))
    rank = ns.world_size // 2 + 3
    t_one = best_of(max(ns.repeat, 20), lambda: lay.rank_groups(rank))
    t_one_cold = best_of(ns.repeat, lambda: RankLayout(ParallelConfig(**kw)).rank_groups(rank))
    print(f"layout bench: world_size={ns.world_size} tp=8 cp=2 pp=8 ep=8, {len(GROUP_NAMES)} kinds, best of {ns.repeat}")
    print(f"  megatron-core RankGenerator, all kinds : {t_meg * 1e3:10.1f} ms")
    print(f"  rankctl RankLayout, all kinds          : {t_all * 1e3:10.1f} ms   {t_meg / t_all:8.0f}x faster")
    print(f"  rankctl rank_groups(one rank)          : {t_one * 1e3:10.3f} ms   {t_meg / t_one:8.0f}x faster")
    print(f"  rankctl config + rank_groups (cold)    : {t_one_cold * 1e3:10.3f} ms   {t_meg / t_one_cold:8.0f}x faster")


if __name__ == "__main__":
    main()
