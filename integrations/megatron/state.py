"""The values of ``megatron.core.parallel_state``'s globals for one rank, from its own groups.

Megatron's ``initialize_model_parallel`` creates every group of every kind on every rank and
keeps the ones the rank belongs to; the tables below name, for each global it sets, the
rankctl kind whose group (or member list) that global holds. The layout reproduces
Megatron's groups exactly (``tests/unit/parallel/test_layout_megatron.py``), so the getters answer the same.
Pure: no torch, no megatron-core; ``init.py`` writes the values.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from rankctl.parallel.layout import ParallelConfig

GLOBAL_NAME = re.compile(r"^_[A-Z][A-Z0-9_]*$|^_global_process_group_list$")   # parallel_state's globals
# global -> kind whose process group it holds
GROUPS: dict[str, str] = {
    "_TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "_PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "_MODEL_PARALLEL_GROUP": "mp",
    "_EMBEDDING_GROUP": "embd",
    "_POSITION_EMBEDDING_GROUP": "pos_embd",
    "_DATA_PARALLEL_GROUP": "dp",
    "_DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",  # one distributed-optimizer instance
    "_CONTEXT_PARALLEL_GROUP": "cp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP": "tp_dp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp_dp_cp",
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp_cp",
    "_EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "_EXPERT_TENSOR_PARALLEL_GROUP": "expt_tp",
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp_ep",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "tp_ep_pp",
    "_EXPERT_DATA_PARALLEL_GROUP": "expt_dp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "expt_dp",
}
# global -> kind whose member list (ascending global ranks) it holds
RANKS: dict[str, str] = {
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp",
    "_PIPELINE_GLOBAL_RANKS": "pp",
    "_MODEL_PARALLEL_GLOBAL_RANKS": "mp",
    "_EMBEDDING_GLOBAL_RANKS": "embd",
    "_POSITION_EMBEDDING_GLOBAL_RANKS": "pos_embd",
    "_DATA_PARALLEL_GLOBAL_RANKS": "dp",
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": "dp_cp",
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": "cp",
    "_EXPERT_MODEL_PARALLEL_RANKS": "ep",
}
# global -> kind whose separate gloo group it holds (Megatron makes gloo copies of these only)
GLOO: dict[str, str] = {
    "_DATA_PARALLEL_GROUP_GLOO": "dp",
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "dp_cp",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "dp_cp",
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO": "expt_dp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": "expt_dp",
}
GLOO_KINDS: tuple[str, ...] = tuple(dict.fromkeys(GLOO.values()))
# megatron-core 0.17+: generalized tensor parallelism with weight rematerialisation ("GTP_remat"), which rankctl runs
# at size 1: the groups "with GTP_remat" are the plain ones (global -> kind), the GTP shard groups one-member.
GTP_GROUPS: dict[str, str] = {
    "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "dp",
    "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": "dp_cp",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": "dp_cp",
    "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "expt_dp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "expt_dp",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP": "tp_ep_pp",
}
GTP_ALONE: tuple[str, ...] = ("_GTP_WEIGHT_REMAT_GROUP", "_EXPERT_GTP_WEIGHT_REMAT_GROUP")
GTP_ALONE_RANKS: tuple[str, ...] = ("_GTP_WEIGHT_REMAT_GLOBAL_RANKS", "_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS")
# Groups of options rankctl does not offer; Megatron leaves them None without those options
# (num_distributed_optimizer_instances > 1, create_all_gather_group, hierarchical cp).
ABSENT: tuple[str, ...] = (
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
    "_DATA_PARALLEL_GROUP_WITH_CP_AG",   # up to 0.17
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
)
# Overrides that only Megatron's set_* functions fill; initialisation leaves them None.
OVERRIDES: tuple[str, ...] = (
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
    "_MPU_DATA_PARALLEL_WORLD_SIZE", "_MPU_DATA_PARALLEL_RANK",
    "_MPU_TENSOR_MODEL_PARALLEL_RANK", "_MPU_PIPELINE_MODEL_PARALLEL_RANK",
    "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE", "_MPU_EXPERT_MODEL_PARALLEL_RANK",
    "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE", "_MPU_EXPERT_TENSOR_PARALLEL_RANK",
)
# Set elsewhere: the memory buffer by ``_set_global_memory_buffer`` (init.py calls it),
# the distributed-optimizer instance group is the world (one instance), the rest by
# features rankctl does not drive (hybrid cp, symmetric memory for inference).
OTHER: tuple[str, ...] = (
    "_GLOBAL_MEMORY_BUFFER", "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK", "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
    "_HYBRID_DP_CP_GROUPS", "_GLOBAL_SYMMETRIC_MEMORY_BUFFER", "_global_process_group_list",   # the buffer: 0.16
)


def megatron_globals(
    config: ParallelConfig,
    groups: Mapping[str, Any],
    ranks: Mapping[str, list[int]],
    gloo: Mapping[str, Any],
    world: Any,
    present: frozenset[str] | None = None,
    alone: Any = None,
    rank: int = 0,
) -> dict[str, Any]:
    """Every global ``initialize_model_parallel`` sets, as rank-local values.

    ``groups``/``ranks`` hold the kinds this rank belongs to (no ``embd``/``pos_embd`` for
    non-members: Megatron leaves those None there), ``gloo`` the gloo group per kind of
    ``GLOO_KINDS`` (empty when gloo groups are off), ``world`` the default group. ``present``: the globals the
    installed megatron-core has (None: every one of the tables'); only those are returned. ``alone``: the group
    of ``rank`` alone, for 0.17+'s GTP shard groups.
    """
    out: dict[str, Any] = {name: groups.get(kind) for name, kind in GROUPS.items()}
    out.update({name: list(ranks[kind]) if kind in ranks else None for name, kind in RANKS.items()})
    out.update({name: gloo.get(kind) for name, kind in GLOO.items()})
    out.update(dict.fromkeys(ABSENT + OVERRIDES))
    # one distributed-optimizer instance: all tp_ep_pp groups together, i.e. the world
    out["_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP"] = world
    if config.vpp is not None:
        out["_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK"] = 0
        out["_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE"] = config.vpp
    extra = []
    if present is not None and GTP_ALONE[0] in present:
        out.update({name: groups.get(kind) for name, kind in GTP_GROUPS.items()})
        out.update(dict.fromkeys(GTP_ALONE, alone))
        out.update({name: [rank] for name in GTP_ALONE_RANKS})
        extra.append(alone)
    out["_global_process_group_list"] = _process_group_list([*groups.values(), *gloo.values(), *extra], world)
    return out if present is None else {name: value for name, value in out.items() if name in present}


def _process_group_list(groups: list[Any], world: Any) -> list[Any]:
    """Megatron's list for ``update_pg_timeout``: None (the default group), then each other group once."""
    seen: dict[int, Any] = {}
    for group in groups:
        if group is not None and group is not world:
            seen.setdefault(id(group), group)
    return [None, *seen.values()]
