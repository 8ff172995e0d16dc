"""``process_groups(ctx)``: Megatron-Core's ``ProcessGroupCollection`` from one rank's own groups, no globals set.

Megatron-Core is moving from the global ``parallel_state`` to a collection passed to each module (``pg_collection=``);
rankctl already builds exactly the groups a rank belongs to, so it hands them over as they are. Every field of the
installed version's ``ProcessGroupCollection`` is set (None where Megatron leaves it None with rankctl's options):
``FIELDS`` names, per field, the rankctl kind whose group it holds; a field the table does not know (a newer
megatron-core) is an error, never a silent None. The members equal those of Megatron's own construction
(``ProcessGroupCollection.use_mpu_process_groups()`` after its ``initialize_model_parallel``):
``tests/integration/test_megatron_conformance.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .protocol import ParallelContext
from .version import MegatronVersionError, installed_version, parallel_state

WORLD, ALONE = "world", "alone"
# ProcessGroupCollection field -> the kind whose group it holds; WORLD: the default group (one distributed-optimizer
# instance); ALONE: the group of this rank alone; None: left None (hierarchical cp, several optimizer instances,
# separate all-gather groups: options rankctl does not offer)
FIELDS: dict[str, str | None] = {
    "tp": "tp", "pp": "pp", "mp": "mp", "embd": "embd", "pos_embd": "pos_embd", "cp": "cp", "tp_cp": "tp_cp",
    "hcp": None, "ep": "ep", "expt_tp": "expt_tp", "tp_ep": "tp_ep", "tp_ep_pp": "tp_ep_pp", "tp_dp_cp": "tp_dp_cp",
    "dp": "dp", "dp_cp": "dp_cp", "expt_dp": "expt_dp", "intra_dp_cp": "dp_cp", "intra_expt_dp": "expt_dp",
    "inter_dist_opt": None, "intra_dist_opt": WORLD,
    # 0.18+: all-gather groups of their own (create_all_gather_groups); 0.19+: GTP_remat, which rankctl runs at size 1
    "dp_cp_ag": None, "expt_dp_ag": None, "tp_ep_pp_with_egtp_remat": "tp_ep_pp", "dp_cp_gtp_remat": "dp_cp",
    "expt_dp_gtp_remat": "expt_dp", "gtp_remat": ALONE, "expt_gtp_remat": ALONE,
}


def process_groups(ctx: ParallelContext | None = None, *, set_globals: bool = False) -> Any:
    """This rank's ``megatron.core.process_groups_config.ProcessGroupCollection``, from ``ctx``'s groups (default:
    ``rankctl.context()``). Every rank of the job must call it (a one-member group may be created). Nothing global is
    set unless ``set_globals``: then ``initialize_model_parallel(ctx)`` fills ``parallel_state`` too, for code that
    still reads it."""
    if ctx is None:
        import rankctl

        ctx = rankctl.context()
    if not isinstance(ctx, ParallelContext):
        raise TypeError("ctx must provide rank, layout, group(kind), ranks(kind) and alone(); "
                        f"got {type(ctx).__name__}")
    parallel_state()   # the version check: a clear error for an unsupported or missing megatron-core
    from megatron.core.process_groups_config import ProcessGroupCollection

    own = ctx.layout.rank_groups(ctx.rank)
    values = {f.name: _value(ctx, own, f.name) for f in dataclasses.fields(ProcessGroupCollection)}
    if set_globals:
        from .init import initialize_model_parallel

        initialize_model_parallel(ctx)
    return ProcessGroupCollection(**values)


def _value(ctx: ParallelContext, own: dict[str, Any], name: str) -> Any:
    if name not in FIELDS:
        raise MegatronVersionError(
            f"megatron-core {installed_version()}'s ProcessGroupCollection has a field {name!r} that "
            "rankctl.megatron does not know; it fills every field or none (rankctl.megatron.collection.FIELDS)")
    kind = FIELDS[name]
    if kind is None:
        return None
    if kind == WORLD:
        import torch.distributed as dist

        return dist.group.WORLD
    if kind == ALONE:
        return ctx.alone()
    return ctx.group(kind) if kind in own else None
