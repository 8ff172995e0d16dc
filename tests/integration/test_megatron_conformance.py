"""rankctl.megatron vs Megatron-Core's own ``initialize_model_parallel``, in the same processes.

Each 8-rank gloo job runs Megatron's initialisation, records every getter of
``parallel_state`` (every argument combination) and every global, destroys it, then builds
only the rank's own groups (``build_context``) and runs ``rankctl.megatron``'s, records
again, and compares. ``new_group`` calls are counted on both paths (``pytest -s`` prints them).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import subprocess
import sys
import time
import tomllib
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

from rankctl.parallel.groups import creation_order
from rankctl.parallel.layout import ParallelConfig, RankLayout

ps = pytest.importorskip("megatron.core.parallel_state")
from ranks import fork_ranks  # noqa: E402

from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402

from rankctl.megatron import build_context, initialize_model_parallel, process_groups  # noqa: E402
from rankctl.megatron import collection, state, version  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GLOBAL = state.GLOBAL_NAME
VARIANTS = {"vp_stage": [None, 0, 1], "group_size": [None]}


# -- what the state answers ---------------------------------------------------------------
def describe(value: Any) -> Any:
    """A comparable picture of a getter's answer: groups become their members, size, rank, backend."""
    if isinstance(value, dist.ProcessGroup):
        return ["group", dist.get_process_group_ranks(value), value.size(), value.rank(), dist.get_backend(value)]
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return ["object", type(value).__name__]


def getter_calls() -> Iterator[tuple[str, Any, dict]]:
    """Every getter of parallel_state with every combination of its optional arguments."""
    for name, fn in sorted(vars(ps).items()):
        if not (inspect.isfunction(fn) and fn.__module__ == ps.__name__):
            continue
        if not name.startswith(("get_", "is_", "has_", "model_parallel_is_initialized")):
            continue
        params = inspect.signature(fn).parameters
        if any(p.default is inspect.Parameter.empty for p in params.values()):
            continue  # get_nccl_options(pg_name, cfgs): a helper, not state
        choices = [
            VARIANTS.get(p.name, [False, True] if isinstance(p.default, bool) else [p.default])
            for p in params.values()
        ]
        for combo in itertools.product(*choices):
            yield name, fn, dict(zip(params, combo))


def answers() -> dict[str, Any]:
    """name(kwargs) -> described answer, or the exception type it raised."""
    out = {}
    for name, fn, kwargs in getter_calls():
        key = f"{name}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"
        try:
            out[key] = describe(fn(**kwargs))
        except Exception as exc:  # noqa: BLE001 - both paths must raise the same
            out[key] = ["raises", type(exc).__name__]
    return out


def collection_fields(pgc: Any) -> dict[str, Any]:
    """Every field of a ProcessGroupCollection, described (an unset field: None, as 0.19's __getattr__ says)."""
    return {f.name: describe(getattr(pgc, f.name, None)) for f in dataclasses.fields(ProcessGroupCollection)}


def globals_now(world: int) -> dict[str, Any]:
    """Every module global of parallel_state; the group list as a set of member lists."""
    out = {name: describe(value) for name, value in vars(ps).items() if GLOBAL.match(name)}
    groups = ps._global_process_group_list or []
    members = {tuple(range(world)) if g is None else tuple(dist.get_process_group_ranks(g)) for g in groups}
    out["_global_process_group_list"] = sorted(members)
    return out


# -- one rank -----------------------------------------------------------------------------
@contextmanager
def counting_new_group() -> Iterator[list[list[int]]]:
    """Count ``torch.distributed.new_group`` calls (Megatron and ProcessGroups look it up per call)."""
    calls: list[list[int]] = []
    original = dist.new_group

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(list(kwargs.get("ranks", args[0] if args else [])))
        return original(*args, **kwargs)

    dist.new_group = counted
    try:
        yield calls
    finally:
        dist.new_group = original


def megatron_kwargs(cfg: ParallelConfig) -> dict:
    return dict(
        tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=cfg.vpp, context_parallel_size=cfg.cp,
        expert_model_parallel_size=cfg.ep, expert_tensor_parallel_size=cfg.etp, order=cfg.order,
    )


def smoke(world: int) -> None:
    """One all-reduce over each state group this rank has: the groups really work."""
    getters = [ps.get_tensor_model_parallel_group, ps.get_pipeline_model_parallel_group,
               lambda: ps.get_data_parallel_group(with_context_parallel=True),
               lambda: ps.get_data_parallel_group_gloo(with_context_parallel=True),
               ps.get_expert_model_parallel_group, ps.get_expert_data_parallel_group_gloo]
    for get in getters:
        t = torch.ones(1)
        dist.all_reduce(t, group=get())
        assert t.item() == get().size()


def compare_one(rank: int, world: int, kw: dict) -> dict:
    """Megatron's initialisation, then rankctl's, in this process; what each made and answered."""
    cfg = ParallelConfig(**kw)
    t0 = time.perf_counter()
    with counting_new_group() as theirs_calls:
        ps.initialize_model_parallel(**megatron_kwargs(cfg))
    t_theirs = time.perf_counter() - t0
    theirs, theirs_globals = answers(), globals_now(world)
    theirs_pgc = collection_fields(ProcessGroupCollection.use_mpu_process_groups())
    ps.destroy_model_parallel()

    layout = RankLayout(cfg)
    t0 = time.perf_counter()
    with counting_new_group() as ours_calls:
        ctx = build_context(rank, layout)
        gloo = initialize_model_parallel(ctx)
    t_ours = time.perf_counter() - t0
    ours, ours_globals = answers(), globals_now(world)
    ours_pgc = collection_fields(process_groups(ctx))
    with pytest.raises(RuntimeError, match="already initialized"):
        initialize_model_parallel(ctx)
    smoke(world)
    alone = ctx.created_alone
    ps.destroy_model_parallel()
    initialize_model_parallel(ctx)  # again, with the same context: fresh gloo groups
    again = answers()
    smoke(world)
    ps.destroy_model_parallel()
    ctx.destroy()
    own = [m for m in creation_order(rank, layout.rank_groups(rank)) if len(m) < world]
    return dict(
        rank=rank, getters=len(ours), globals=len(ours_globals),
        diff=sorted(k for k in theirs.keys() | ours.keys() | again.keys()
                    if not theirs.get(k) == ours.get(k) == again.get(k)),
        diff_globals=sorted(k for k in theirs_globals.keys() | ours_globals.keys()
                            if theirs_globals.get(k) != ours_globals.get(k)),
        fields=len(ours_pgc), diff_fields=sorted(k for k in theirs_pgc.keys() | ours_pgc.keys()
                                                 if theirs_pgc.get(k) != ours_pgc.get(k)),
        megatron=len(theirs_calls), rankctl=len(ours_calls),
        process_groups=len(own), alone=alone, gloo=len(gloo),
        t_megatron=t_theirs, t_rankctl=t_ours,
    )


def rank_main(rank: int, world: int, store_path: str, out: str, kw: dict) -> None:
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    result = compare_one(rank, world, kw)
    dist.barrier()
    dist.destroy_process_group()
    Path(out, f"{rank}.json").write_text(json.dumps(result))


def run_job(tmp_path: Path, kw: dict) -> list[dict]:
    codes = fork_ranks(kw["world_size"], rank_main, str(tmp_path / "store"), str(tmp_path), kw)
    assert codes == [0] * kw["world_size"], f"rank exit codes {codes} (tracebacks above)"
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(kw["world_size"])]


def report(name: str, results: list[dict]) -> None:
    print(f"\n{name}: {results[0]['getters']} getter calls, {results[0]['globals']} globals and "
          f"{results[0]['fields']} ProcessGroupCollection fields compared per rank")
    print("  rank  new_group megatron  rankctl (= ProcessGroups + one-member + gloo)  init ms megatron / rankctl")
    for r in results:
        print(f"  {r['rank']:>4}  {r['megatron']:>18}  {r['rankctl']:>7} (= {r['process_groups']} + {r['alone']} + "
              f"{r['gloo']}){'':>23}{r['t_megatron'] * 1e3:8.1f} / {r['t_rankctl'] * 1e3:.1f}")


def check(results: list[dict]) -> None:
    for r in results:
        assert not r["diff"], f"rank {r['rank']}: getters differ: {r['diff']}"
        assert not r["diff_globals"], f"rank {r['rank']}: globals differ: {r['diff_globals']}"
        assert not r["diff_fields"], f"rank {r['rank']}: ProcessGroupCollection fields differ: {r['diff_fields']}"
        assert r["rankctl"] == r["process_groups"] + r["alone"] + r["gloo"], r
        assert r["rankctl"] * 4 <= r["megatron"], r


# -- the jobs -------------------------------------------------------------------------------
def test_tp2_pp2_dp2_state_equals_megatrons(tmp_path: Path) -> None:
    results = run_job(tmp_path, dict(world_size=8, tp=2, pp=2, vpp=2))
    report("tp2 pp2 dp2 vpp2", results)
    check(results)


def test_cp_ep_etp_state_equals_megatrons(tmp_path: Path) -> None:
    results = run_job(tmp_path, dict(world_size=8, tp=2, cp=2, pp=2, ep=2, etp=1))
    report("tp2 cp2 pp2 ep2 etp1 (dp1, expert dp2)", results)
    check(results)


def test_moe_with_expert_tp_state_equals_megatrons(tmp_path: Path) -> None:
    results = run_job(tmp_path, dict(world_size=4, tp=2, ep=2, etp=2))
    report("tp2 dp2 ep2 etp2 (expert dp1)", results)
    check(results)


# -- without processes ----------------------------------------------------------------------
def test_every_megatron_global_and_collection_field_is_accounted_for() -> None:
    ours = {*state.GROUPS, *state.RANKS, *state.GLOO, *state.ABSENT, *state.OVERRIDES, *state.OTHER,
            *state.GTP_GROUPS, *state.GTP_ALONE, *state.GTP_ALONE_RANKS}
    theirs = {name for name in vars(ps) if GLOBAL.match(name)}
    assert not theirs - ours, f"only Megatron's: {sorted(theirs - ours)}"
    fields = {f.name for f in dataclasses.fields(ProcessGroupCollection)}
    assert not fields - collection.FIELDS.keys(), f"fields rankctl does not fill: {sorted(fields - collection.FIELDS.keys())}"


def test_a_collection_field_rankctl_does_not_know_is_an_error_naming_it() -> None:
    with pytest.raises(version.MegatronVersionError, match="a field 'brand_new' that rankctl.megatron does not know"):
        collection._value(_Ctx(), {}, "brand_new")
    with pytest.raises(RuntimeError, match=r"rankctl.context\(\) is only available inside a rank"):
        process_groups()


def test_supported_range_is_the_extra() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["megatron"] == [f"megatron-core{version.SUPPORTED}"]
    assert version.is_supported(version.installed_version() or "")


@pytest.mark.parametrize("found", ["0.15.3", "0.17.0", "0.18.2", "0.17.0rc1", "0.20.0", "1.16.0"])
def test_unsupported_megatron_names_version_range_and_command(monkeypatch: pytest.MonkeyPatch, found: str) -> None:
    monkeypatch.setattr(version, "installed_version", lambda: found)
    with pytest.raises(version.MegatronVersionError) as err:
        initialize_model_parallel(object.__new__(_Ctx))
    assert found in str(err.value) and version.SUPPORTED in str(err.value) and "pip install" in str(err.value)


def test_missing_megatron_is_an_import_error_with_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(version, "installed_version", lambda: None)
    with pytest.raises(ImportError, match=r"not installed.*pip install 'rankctl\[megatron\]'"):
        initialize_model_parallel(object.__new__(_Ctx))


def test_supported_versions() -> None:
    assert [version.is_supported(v) for v in ("0.16.0", "0.16.1", "0.16.0rc2", "0.16", "0.19.2", "0.19.0rc1")] \
        == [True] * 6
    assert [version.is_supported(v) for v in ("0.15.9", "0.17.0", "0.18.2", "0.20.0", "0.160.0", "0.190", "x")] \
        == [False] * 7


def test_without_a_context_it_uses_the_ranks_and_outside_a_rank_says_so() -> None:
    with pytest.raises(RuntimeError, match=r"rankctl.context\(\) is only available inside a rank"):
        initialize_model_parallel()
    with pytest.raises(RuntimeError, match=r"rankctl.context\(\) is only available inside a rank"):
        initialize_model_parallel(None)
    with pytest.raises(TypeError, match="must provide rank, layout"):
        initialize_model_parallel(object())


def test_import_needs_neither_torch_nor_megatron() -> None:
    code = "import sys, rankctl.megatron; print(sorted(m for m in ('torch', 'megatron') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


class _Ctx:
    """Satisfies the protocol's shape; the version check comes before it is used."""

    rank = 0
    layout = None

    def group(self, kind: str) -> Any: ...

    def ranks(self, kind: str) -> list[int]: ...

    def alone(self) -> Any: ...
