"""``initialize_model_parallel(ctx)``: Megatron-Core's parallel state from this rank's own groups.

Megatron makes every rank create every group of every kind (about 3.35 x world + 1,433
``new_group`` calls per rank); here a rank creates only the gloo copies Megatron keeps for
data-parallel kinds, and only its own, on top of the groups its context already holds.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Any

from rankctl.parallel.layout import GROUP_NAMES

from .protocol import ParallelContext
from .state import GLOBAL_NAME, GLOO_KINDS, GTP_ALONE, megatron_globals
from .version import parallel_state

if TYPE_CHECKING:
    import torch.distributed as dist

Members = tuple[int, ...]

# How many times this process has initialised: part of the gloo groups' names, so that
# initialising again after ``destroy_model_parallel`` never meets the store keys of the
# destroyed groups (same members, same name). Every rank of a job initialises as often.
_generation = itertools.count()


def initialize_model_parallel(
    ctx: ParallelContext | None = None,
    *,
    create_gloo_process_groups: bool = True,
    timeout: timedelta | None = None,
) -> dict[Members, "dist.ProcessGroup"]:
    """Fill ``megatron.core.parallel_state`` so that its getters answer as after Megatron's own
    ``initialize_model_parallel`` with the layout's sizes and order; returns the gloo groups
    created here (member list -> group). Every rank of the job must call it.

    ``parallel_state.destroy_model_parallel()`` undoes it and destroys only those gloo
    groups; the context's groups stay the context's.
    """
    if ctx is None:  # the running rank's (a rankctl job); elsewhere rankctl.context() says why it has none
        import rankctl

        ctx = rankctl.context()
    if not isinstance(ctx, ParallelContext):
        raise TypeError(f"ctx must provide rank, layout, group(kind) and ranks(kind); got {type(ctx).__name__}")
    ps = parallel_state()
    if ps._DATA_PARALLEL_GROUP is not None or ps._TENSOR_MODEL_PARALLEL_GROUP is not None:
        raise RuntimeError(
            "Megatron-Core's parallel state is already initialized; "
            "call megatron.core.parallel_state.destroy_model_parallel() first"
        )
    values, gloo = _values(ctx, ps, create_gloo_process_groups, timeout)
    for name, value in values.items():
        setattr(ps, name, value)
    ps._set_global_memory_buffer()
    return gloo


def _values(
    ctx: ParallelContext, ps: ModuleType, with_gloo: bool, timeout: timedelta | None
) -> tuple[dict[str, Any], dict[Members, "dist.ProcessGroup"]]:
    """The globals' values (those ``ps``, the installed ``parallel_state``, has), creating the gloo groups; nothing
    is written yet."""
    import torch.distributed as dist

    own = ctx.layout.rank_groups(ctx.rank)
    # GROUP_NAMES order, then gloo copies by member list: a fixed order on every rank, so a
    # context that creates groups lazily cannot deadlock (see parallel/groups.py).
    groups = {name: ctx.group(name) for name in GROUP_NAMES if name in own}
    ranks = {kind: ctx.ranks(kind) for kind in groups}
    gloo = _gloo_groups(ranks, timeout, next(_generation)) if with_gloo else {}
    gloo_by_kind = {kind: gloo[tuple(sorted(ranks[kind]))] for kind in GLOO_KINDS} if with_gloo else {}
    present = frozenset(name for name in vars(ps) if GLOBAL_NAME.match(name))
    alone = ctx.alone() if GTP_ALONE[0] in present else None
    return megatron_globals(ctx.layout.config, groups, ranks, gloo_by_kind, dist.group.WORLD, present, alone,
                            ctx.rank), gloo


def _gloo_groups(
    ranks: dict[str, list[int]], timeout: timedelta | None, generation: int
) -> dict[Members, "dist.ProcessGroup"]:
    """One gloo group per distinct member list of ``GLOO_KINDS``, created in ascending order.

    Never the default group, even for the whole world: Megatron's ``destroy_model_parallel``
    destroys the gloo groups it finds.
    """
    import torch.distributed as dist

    from .naming import salted_names

    out: dict[Members, dist.ProcessGroup] = {}
    with salted_names(f"gloo{generation}"):
        for members in sorted({tuple(sorted(ranks[kind])) for kind in GLOO_KINDS}):
            out[members] = dist.new_group(
                list(members), backend="gloo", timeout=timeout, use_local_synchronization=True
            )
    return out
