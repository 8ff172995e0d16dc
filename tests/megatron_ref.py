"""Reference layout from megatron-core itself: the checks of ``initialize_model_parallel`` and
its two ``RankGenerator``s, without a process group. Test-only (megatron-core is a dev extra)."""

from __future__ import annotations

import warnings

KIND_TOKENS = {
    "tp": ("dense", "tp"), "pp": ("dense", "pp"), "dp": ("dense", "dp"), "cp": ("dense", "cp"),
    "dp_cp": ("dense", "dp-cp"), "mp": ("dense", "tp-pp"), "tp_cp": ("dense", "tp-cp"),
    "tp_dp": ("dense", "tp-dp"), "tp_dp_cp": ("dense", "tp-dp-cp"),
    "ep": ("expert", "ep"), "expt_tp": ("expert", "tp"), "tp_ep": ("expert", "tp-ep"),
    "tp_ep_pp": ("expert", "tp-ep-pp"), "expt_dp": ("expert", "dp"),
}


def rank_generator_cls():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.parallel_state import RankGenerator
    return RankGenerator


def megatron_groups(world_size, tp=1, pp=1, cp=1, ep=1, etp=None, vpp=None, order="tp-cp-ep-dp-pp"):
    """Every kind's groups as megatron-core builds them, or raise what Megatron raises."""
    RankGenerator = rank_generator_cls()
    model_size = tp * pp * cp
    if world_size % model_size != 0:
        raise RuntimeError(f"world_size ({world_size}) is not divisible by {model_size}")
    dp = world_size // model_size
    if vpp is not None and not pp > 1:
        raise RuntimeError("pipeline-model-parallel size should be greater than 1 with interleaved schedule")
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order, rank_offset=0)
    etp = tp if etp is None else etp
    expert_model = etp * ep * pp
    edp = world_size // expert_model
    if world_size % expert_model != 0:
        raise RuntimeError("world_size is not divisible by expert_tensor_model_pipeline_parallel size")
    expert = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order, rank_offset=0)
    if not (order.endswith("pp") or pp == 1 or edp == dp):
        raise AssertionError("When not using pp-last rank ordering, dp sizes must be the same")
    if dense.get_ranks("pp") != expert.get_ranks("pp"):
        raise AssertionError("Pipeline parallel groups are expected to be the same")
    gens = {"dense": dense, "expert": expert}
    out = {kind: gens[g].get_ranks(tok) for kind, (g, tok) in KIND_TOKENS.items()}
    out["embd"] = [[g[0]] if len(g) == 1 else [g[0], g[-1]] for g in out["pp"]]
    out["pos_embd"] = [[g[0]] for g in out["pp"]]
    return out
