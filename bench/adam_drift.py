"""Why a parallel layout's final parameters can sit ~1e-5 off the serial run's while every
loss agrees: the per-step AdamW history of single parameter elements.

Trains the job of ``tests/e2e/test_e2e_parallel.py`` (``--config parallel``: 4 layers, lr 3e-3,
10 steps) or ``tests/e2e/test_e2e_train.py`` (``--config train``: 2 layers, lr 1e-2, 20 steps),
built by the test's own ``job_yaml``, serially and in the layouts given, each in forked gloo
ranks over a FileStore running the real ``kinds.train.loop`` code. Optimizer step hooks record,
per step and parameter, the clipped gradient Adam sees, ``exp_avg``, ``exp_avg_sq`` and the
parameter after the step (``worker/`` is not changed). Against the serial run it prints:

* the serial elements whose ``sqrt(v_hat)`` ever fell below eps (there Adam's update is
  ~ ``lr * g / eps``, so fp32 rounding in ``g`` is amplified by ``lr / eps``);
* per layout: the largest final-parameter difference, how many elements pass 1e-6 / 2.5e-6 /
  1e-5, the largest step-1 gradient difference relative to its tensor, and the verdict of the
  losses (1e-5 relative) and of ``tests/compare.assert_params_close``;
* for the watched elements and each layout's worst: per step both gradients, ``m_hat``,
  ``sqrt(v_hat)`` (against eps), both updates and the accumulated parameter difference.

``--perturb NAME:X`` adds a run of the first layout with a fake layout bug in one parameter's
gradient; ``--other-seed`` one of the serial job with another seed: both must fail.

    .venv/bin/python bench/adam_drift.py [--config parallel|train] [--layouts cp2 ...]
        [--watch NAME:I,J ...] [--perturb layers.1.ln1.bias:1e-2] [--other-seed]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_e2e_parallel as e2e_parallel  # noqa: E402
import test_e2e_train as e2e_train  # noqa: E402
from compare import MAX_NOISY, TOL, adam_drift_bound, assert_params_close, lr_schedule, noisy_elements  # noqa: E402

from rankctl.contract.jobfile import load_yaml_text  # noqa: E402
from rankctl.kinds.spec import build_spec, parse_spec  # noqa: E402
from rankctl.parallel.groups import ProcessGroups  # noqa: E402
from rankctl.parallel.layout import ParallelConfig, RankLayout  # noqa: E402
from rankctl.kinds.train import optim, loop as train  # noqa: E402
from rankctl.contract.assignment import RankAssignment  # noqa: E402
from rankctl.runtime.rank import RankContext  # noqa: E402
from rankctl.runtime.status import StatusWriter  # noqa: E402




def layouts(config: str) -> list[str]:
    if config == "parallel":
        return list(e2e_parallel.LAYOUTS)
    return [f"tp{tp}-sp{int(sp)}-dp{dp}" for tp, sp, dp in e2e_train.LAYOUTS]


def spec_of(config: str, name: str, seed: int | None = None, steps: int | None = None) -> tuple[dict[str, Any], int]:
    """(validated spec, world size) of a layout of an e2e test module (``serial``: the reference)."""
    if config == "parallel":
        par, (nodes, slots), pos = ({}, (1, 1), "learned") if name == "serial" else e2e_parallel.LAYOUTS[name]
        text, world = e2e_parallel.job_yaml(name, par, nodes, slots, pos), nodes * slots
    else:
        tp, sp, dp = (1, False, 1) if name == "serial" else next(lay for lay in e2e_train.LAYOUTS if
                                                                   f"tp{lay[0]}-sp{int(lay[1])}-dp{lay[2]}" == name)
        text, world = e2e_train.job_yaml(name, tp, sp, dp), tp * dp
    spec = build_spec(load_yaml_text(text)).to_dict()
    spec["train"]["checkpoint_every"] = 0
    if steps is not None:
        spec["train"]["steps"] = steps
    if seed is not None:
        spec["train"]["seed"] = seed
    return spec, world


def assignment(spec: dict[str, Any], world: int, rank: int, run_dir: str) -> RankAssignment:
    par = spec.get("parallel") or {}
    lay = RankLayout(ParallelConfig(world_size=world, **{k: par[k] for k in ("tp", "cp", "pp", "vpp") if par.get(k)}))
    return RankAssignment(job_id="drift", attempt=0, rank=rank, world_size=world, local_rank=rank, node="n0",
                          coords=lay.coords(rank), groups=lay.rank_groups(rank), rendezvous="filestore:0",
                          backend="gloo", kind="train", spec=parse_spec(spec), run_dir=run_dir)


def record_adam(trace: list[dict[str, Any]], perturb: tuple[str, float] | None = None) -> None:
    """In a rank: append each optimizer step's clipped gradients and Adam state to ``trace``.
    ``perturb`` (name, x): add x times the gradient's neighbour (``roll(1)``) to that parameter's
    gradient before every step: a fake layout bug that turns the gradient's direction (a scale
    alone would not do: Adam's update is invariant to it)."""
    build, named = optim.build_optimizer, {}

    def build_and_remember(params, lr, **kw):  # noqa: ANN001, ANN003 - optim.build_optimizer's signature
        params = list(params)
        named.update({id(p): n for n, p in params})
        return build(params, lr, **kw)

    def before(opt, args, kwargs) -> None:  # noqa: ANN001
        params = [p for g in opt.param_groups for p in g["params"]]
        for p in params:
            if perturb and named[id(p)] == perturb[0]:
                p.grad.add_(p.grad.roll(1) * perturb[1])
        trace.append({"lr": opt.param_groups[0]["lr"], "grad": {named[id(p)]: p.grad.detach().clone() for p in params}})

    def after(opt, args, kwargs) -> None:  # noqa: ANN001
        for p in (p for g in opt.param_groups for p in g["params"]):
            for key, value in (("m", opt.state[p]["exp_avg"]), ("v", opt.state[p]["exp_avg_sq"]), ("p", p.detach())):
                trace[-1].setdefault(key, {})[named[id(p)]] = value.clone()

    optim.build_optimizer = build_and_remember
    register_optimizer_step_pre_hook(before)
    register_optimizer_step_post_hook(after)


def rank_main(a: RankAssignment, store_path: str, perturb: tuple[str, float] | None, threads: int | None) -> None:
    timeout = timedelta(seconds=120)
    spec = a.spec
    if threads:  # train.setup gives each rank os.cpu_count() // slots threads
        os.cpu_count = lambda: threads * spec.resources.slots_per_node
    dist.init_process_group("gloo", store=dist.FileStore(store_path, a.world_size), rank=a.rank,
                            world_size=a.world_size, timeout=timeout)
    pgs = ProcessGroups.build(a.rank, a.world_size, a.groups, timeout=timeout)
    trace: list[dict[str, Any]] = []
    record_adam(trace, perturb)
    status = StatusWriter(a.run_dir, a.rank)
    ctx = RankContext(assignment=a, spec=spec, groups=pgs, device=torch.device("cpu"), backend="gloo", status=status,
                      log=structlog.wrap_logger(structlog.ReturnLogger()))
    t = train.setup(ctx)
    result = train.train(t)
    torch.save({"coords": dict(a.coords), "meta": t.meta(), "steps": trace, "losses": result["losses"]},
               os.path.join(a.run_dir, f"trace-{a.rank}.pt"))
    status.close()
    pgs.destroy()
    dist.destroy_process_group()


def run_layout(config: str, name: str, root: str, *, seed: int | None = None,
               perturb: tuple[str, float] | None = None, label: str | None = None,
               threads: int | None = None, steps: int | None = None) -> dict[str, Any]:
    """Train ``name`` in forked ranks; per step, full (serial-shaped) tensors of every record."""
    spec, world = spec_of(config, name, seed, steps)
    run_dir = os.path.join(root, label or name)
    os.makedirs(run_dir)
    pids = []
    for rank in range(world):
        if (pid := os.fork()) == 0:
            code = 0
            try:
                rank_main(assignment(spec, world, rank, run_dir), os.path.join(run_dir, "store"), perturb, threads)
            except BaseException:  # noqa: BLE001 - report, never return into the parent's code
                traceback.print_exc()
                code = 1
            os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    if codes != [0] * world:
        raise SystemExit(f"{name}: ranks exited {codes}")
    traces = [torch.load(os.path.join(run_dir, f"trace-{r}.pt"), weights_only=False) for r in range(world)]
    losses = next(t["losses"] for t in reversed(traces) if t["losses"][0]["loss"] is not None)
    return {"steps": assemble(traces), "losses": [x["loss"] for x in losses]}


def assemble(traces: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per step, serial-shaped tensors from the ranks with dp = cp = 0 (TP shards concatenated;
    a tied head copy on a later stage left out, as ``export_full_state_dict`` does)."""
    keep = [t for t in traces if t["coords"].get("dp", 0) == 0 and t["coords"].get("cp", 0) == 0]
    metas = {n: m for t in keep for n, m in t["meta"].items()}
    steps = []
    for s in range(len(keep[0]["steps"])):
        row: dict[str, Any] = {"lr": keep[0]["steps"][s]["lr"]}
        for key in ("grad", "m", "v", "p"):
            parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
            for t in keep:
                for n, x in t["steps"][s][key].items():
                    if metas[n].init_key == n or metas[n].init_key not in metas:
                        parts.setdefault(n, []).append((metas[n].tp_rank, x))
            row[key] = {n: full_tensor(sorted(ps, key=lambda p: p[0]), metas[n]) for n, ps in parts.items()}
        steps.append(row)
    return steps


def full_tensor(parts: list[tuple[int, torch.Tensor]], meta: Any) -> torch.Tensor:
    if meta.shard_dim is None:
        return parts[0][1]
    full = torch.cat([x for _, x in parts], dim=meta.shard_dim)
    return full.narrow(meta.shard_dim, 0, meta.full_shape[meta.shard_dim])


def update(row: dict[str, Any], name: str, idx: tuple[int, ...], t: int) -> tuple[float, float, float, float]:
    """(g, m_hat, sqrt(v_hat), Adam's step without weight decay) of one element at step ``t``."""
    b1, b2 = optim.BETAS
    bc1, bc2 = 1 - b1**t, 1 - b2**t
    m, v = float(row["m"][name][idx]), float(row["v"][name][idx])
    s = math.sqrt(v / bc2)
    return float(row["grad"][name][idx]), m / bc1, s, row["lr"] / bc1 * m / (s + optim.EPS)


def history(ref: list[dict[str, Any]], ours: list[dict[str, Any]], name: str, idx: tuple[int, ...], label: str) -> None:
    print(f"\n{name}{list(idx)}: serial vs {label}. g: the clipped gradient Adam sees; "
          f"u = lr/bc1 * m/(sqrt(v/bc2) + eps), eps = {optim.EPS:.0e}")
    print(f"{'step':>4} {'lr':>8} {'g serial':>11} {'g ' + label:>11} {'|dg|':>9} {'m_hat':>10} "
          f"{'sqrt(v_hat)':>11} {'u serial':>10} {'u ' + label:>10} {'|du|':>9} {'|dp|':>9}")
    for t, (a, b) in enumerate(zip(ref, ours), start=1):
        (ga, ma, sa, ua), (gb, _, _, ub) = update(a, name, idx, t), update(b, name, idx, t)
        dp = abs(float(a["p"][name][idx]) - float(b["p"][name][idx]))
        print(f"{t:>4} {a['lr']:>8.2e} {ga:>11.3e} {gb:>11.3e} {abs(ga - gb):>9.2e} {ma:>10.3e} "
              f"{sa:>11.3e} {ua:>10.3e} {ub:>10.3e} {abs(ua - ub):>9.2e} {dp:>9.2e}")


def at_risk(ref: list[dict[str, Any]]) -> list[tuple[str, tuple[int, ...], float]]:
    """Serial elements whose Adam denominator ever fell below eps (min_t sqrt(v_hat) < eps) with a
    nonzero gradient at some step: there the update is ~ lr g / eps, so rounding in g shows."""
    b2, out = optim.BETAS[1], []
    for name in ref[0]["v"]:
        s = torch.stack([(row["v"][name] / (1 - b2**t)).sqrt() for t, row in enumerate(ref, start=1)]).amin(0)
        moved = torch.stack([row["grad"][name] != 0 for row in ref]).any(0)
        out += [(name, tuple(int(i) for i in ix), float(s[tuple(ix)])) for ix in ((s < optim.EPS) & moved).nonzero()]
    return out


def verdict(ref: dict[str, Any], ours: dict[str, Any], lrs: list[float]) -> str:
    bad = [s + 1 for s, (a, b) in enumerate(zip(ours["losses"], ref["losses"])) if abs(a - b) > 1e-5 * max(abs(a), abs(b))]
    try:
        assert_params_close(ours["steps"][-1]["p"], ref["steps"][-1]["p"], lrs)
        params = "params PASS"
    except AssertionError as exc:
        params = f"params FAIL ({str(exc)[:160]})"
    return f"losses {'PASS' if not bad else f'FAIL at steps {bad}'}; {params}"


def summarise(ref: dict[str, Any], ours: dict[str, Any], label: str, lrs: list[float]) -> tuple[str, tuple[int, ...]]:
    """Print a run's figures against the serial run; return its worst final-parameter element."""
    first_a, first_b, last_a, last_b = ref["steps"][0], ours["steps"][0], ref["steps"][-1], ours["steps"][-1]
    dg = max((float((first_a["grad"][k] - first_b["grad"][k]).abs().max() / first_a["grad"][k].abs().max()), k)
             for k in first_a["grad"] if first_a["grad"][k].abs().max() > 0)
    worst = max(((float((last_a["p"][k] - last_b["p"][k]).abs().max()), k) for k in last_a["p"]))
    d = (last_a["p"][worst[1]] - last_b["p"][worst[1]]).abs()
    idx = tuple(int(i) for i in torch.unravel_index(d.argmax(), d.shape))
    diffs = torch.cat([(last_a["p"][k] - last_b["p"][k]).abs().flatten() for k in last_a["p"]])
    tail = ", ".join(f"{int((diffs > x).sum())} > {x:.1e}" for x in (1e-6, 2.5e-6, TOL))
    print(f"{label:>18}: max |dp| {worst[0]:.3e} at {worst[1]}{list(idx)}; of {diffs.numel()} elements {tail} "
          f"({len(noisy_elements(last_b['p'], last_a['p']))} past the rtol+atol check); step-1 |dg| / max|g| of "
          f"the tensor <= {dg[0]:.1e} ({dg[1]}); {verdict(ref, ours, lrs)}")
    return worst[1], idx


def loss_drift(ref: list[float], ours: list[float], label: str) -> None:
    """The losses against the serial run's: the steps within 1e-5 relative before the first that is not, and
    the largest relative difference (what README.md and ``ctl plan`` state)."""
    rel = [abs(a - b) / abs(b) for a, b in zip(ours, ref)]
    first = next((s + 1 for s, r in enumerate(rel) if r > 1e-5), None)
    worst = max(range(len(rel)), key=rel.__getitem__)
    held = f"steps 1-{first - 1} within 1e-5, first past it: step {first} ({rel[first - 1]:.1e})" if first \
        else f"all {len(rel)} steps within 1e-5"
    print(f"{label}: losses {held}; largest {rel[worst]:.1e} at step {worst + 1} of {len(rel)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=("parallel", "train"), default="parallel",
                    help="the job of tests/e2e/test_e2e_parallel.py or tests/e2e/test_e2e_train.py")
    ap.add_argument("--layouts", nargs="+", help="default: the layouts CI reported (parallel), or three "
                    "dp layouts (train)")
    ap.add_argument("--watch", nargs="*", help="elements NAME:I,J whose history to print besides each layout's "
                    "worst (default for parallel: the one CI reported)")
    ap.add_argument("--perturb", default="", help="NAME:X: also run the first layout with X times its "
                                                   "neighbour added to that parameter's gradient (a fake bug)")
    ap.add_argument("--serial-threads", type=int, default=0, help="also run the serial job with this many "
                    "threads (another summation order in the same layout: the control)")
    ap.add_argument("--other-seed", action="store_true", help="also compare a serial run with seed + 1")
    ap.add_argument("--steps", type=int, default=None, help="train this many steps (default: the test's)")
    args = ap.parse_args()
    args.layouts = args.layouts or (["cp2", "cp2-tp2", "tp2-sp-cp2-pp2"] if args.config == "parallel" else
                                    ["tp1-sp0-dp4", "tp2-sp1-dp2", "tp4-sp0-dp2"])
    spec, _ = spec_of(args.config, "serial", steps=args.steps)
    tr = spec["train"]
    lrs = lr_schedule(tr["lr"], tr["warmup"], tr["steps"])
    print(f"AdamW betas {optim.BETAS}, eps {optim.EPS}, weight decay {optim.WEIGHT_DECAY}; lr per step "
          f"{[f'{x:.2e}' for x in lrs]}\nadam_drift_bound (tests/compare.py): {adam_drift_bound(lrs):.3e}; "
          f"at most {MAX_NOISY} elements may pass {TOL}")
    with tempfile.TemporaryDirectory(prefix="adam-drift-") as root:
        ref = run_layout(args.config, "serial", root, steps=args.steps)
        runs = {name: run_layout(args.config, name, root, steps=args.steps) for name in args.layouts}
        if args.perturb:
            name, x = args.perturb.split(":")
            label = f"{args.layouts[0]} bug {x}"
            runs[label] = run_layout(args.config, args.layouts[0], root, perturb=(name, float(x)), label=label)
        if args.serial_threads:
            runs[f"serial {args.serial_threads} thr"] = run_layout(args.config, "serial", root, label="threads",
                                                                   threads=args.serial_threads)
        if args.other_seed:
            runs[f"seed {tr['seed'] + 1}"] = run_layout(args.config, "serial", root, seed=tr["seed"] + 1, label="seed")
    risky = at_risk(ref["steps"])
    print(f"serial elements whose sqrt(v_hat) fell below eps at some step: {len(risky)}: "
          f"{[(n, list(i), f'{s:.2e}') for n, i, s in risky[:8]]}")
    worst = {name: summarise(ref, ours, name, lrs) for name, ours in runs.items()}
    for name, ours in runs.items():
        loss_drift(ref["losses"], ours["losses"], name)
    if args.watch is None:
        args.watch = ["layers.2.mlp.proj.weight:0,72"] if args.config == "parallel" else []
    watch = [(w.split(":")[0], tuple(int(i) for i in w.split(":")[1].split(","))) for w in args.watch]
    for name in args.layouts:
        for elem in dict.fromkeys([*watch, worst[name]]):
            history(ref["steps"], runs[name]["steps"], *elem, name)


if __name__ == "__main__":
    main()
