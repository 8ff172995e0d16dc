"""``ctl run``'s job file: torchrun's command line as a ``kind: python`` job (pure: no grpc, no torch).

torchrun's flags map onto the job file's fields: ``--nnodes N`` or ``MIN:MAX`` -> ``resources.nodes`` (and
``resources.min_nodes``: elastic), ``--nproc-per-node`` -> ``resources.slots_per_node``, ``--max-restarts`` ->
``restart.max_restarts``, ``--rdzv-id`` -> ``name``, ``-m`` -> ``python.module``, the script and its arguments ->
``python.entrypoint`` and ``python.args``; the working directory is shipped as ``python.workdir`` (the script must
lie inside it), and ``--env`` sets ``python.env`` (the ranks run in their daemons' environment, not the caller's).
What the coordinator does itself (rendezvous, addresses, log files) is accepted and left to it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rankctl.cli.errors import CtlError
from rankctl.contract import limits as L
from rankctl.contract.names import JOB_NAME_RE

PROCS = ("auto", "cpu", "gpu")
GPU_DEVICE = re.compile(r"nvidia\d+")
# torchrun's flags that rankctl's coordinator and daemons take the place of: accepted, noted, not used
IGNORED = ("--rdzv-conf", "--node-rank", "--master-addr", "--master-port", "--local-addr", "--monitor-interval",
           "--start-method", "--role", "--log-dir", "--redirects", "--tee", "--logs-specs", "--event-log-handler",
           "--numa-binding", "--signals-to-handle", "--shutdown-timeout", "--duplicate-stdout-filters",
           "--duplicate-stderr-filters")
IGNORED_FLAGS = ("--virtual-local-rank",)
SHORT = {"--redirects": "-r", "--tee": "-t"}


@dataclass(frozen=True, kw_only=True)
class RunArgs:
    """What ``ctl run`` was given, as torchrun names it."""

    nnodes: str = "1"
    nproc_per_node: str = "1"
    max_restarts: int = 0
    rdzv_id: str = ""
    module: bool = False
    no_python: bool = False
    target: str = ""                       # the script, or the module with ``module``
    args: tuple[str, ...] = ()
    workdir: Path = field(default_factory=Path.cwd)
    local_ranks_filter: str = ""
    env: tuple[str, ...] = ()              # NAME=VALUE, or NAME: this environment's value
    parallel: tuple[tuple[str, int], ...] = ()   # --tp 2 --pp 2 ...: the Megatron layout (``parallel.*``)


def node_range(text: str) -> tuple[int, int]:
    """``--nnodes``: ``N`` or ``MIN:MAX`` -> (fewest, most)."""
    low, sep, high = text.partition(":")
    if not (low.isascii() and low.isdigit() and (not sep or high.isascii() and high.isdigit())):
        raise CtlError(f"--nnodes {text!r} must be N or MIN:MAX (whole numbers), as torchrun takes it")
    least, most = int(low), int(high if sep else low)
    if not 1 <= least <= most <= L.MAX_NODES:
        raise CtlError(f"--nnodes {text!r}: need 1 <= MIN <= MAX <= {L.MAX_NODES}")
    return least, most


def gpus_here(dev: Path = Path("/dev")) -> int:
    """GPUs this machine shows (``/dev/nvidiaN``), without importing torch."""
    try:
        return sum(1 for p in dev.iterdir() if GPU_DEVICE.fullmatch(p.name))
    except OSError:
        return 0


def procs_per_node(text: str, gpus: int | None = None, cpus: int | None = None) -> tuple[int, str]:
    """``--nproc-per-node``: a number, or torchrun's ``gpu``/``cpu``/``auto`` counted on this machine (as torchrun
    counts on each node): (slots, how it was found, "" for a number)."""
    if text.isascii() and text.isdigit():
        n, how = int(text), ""
    elif text in PROCS:
        gpus = gpus_here() if gpus is None else gpus
        cpus = (os.cpu_count() or 1) if cpus is None else cpus
        n = gpus if text == "gpu" or (text == "auto" and gpus) else cpus
        how = f"--nproc-per-node {text}: {n} (this machine's {'GPUs' if n == gpus and text != 'cpu' else 'CPUs'})"
    else:
        raise CtlError(f"--nproc-per-node {text!r} must be a number or one of {', '.join(PROCS)}")
    if not 1 <= n <= L.MAX_SLOTS_PER_NODE:
        raise CtlError(f"--nproc-per-node {text!r} gives {n}: must be 1 to {L.MAX_SLOTS_PER_NODE}")
    return n, how


def local_ranks(text: str) -> frozenset[int] | None:
    """``--local-ranks-filter 0,3``: the local ranks whose output is shown (None: all)."""
    if not text:
        return None
    parts = text.split(",")
    if not all(p.isascii() and p.isdigit() for p in parts):
        raise CtlError(f"--local-ranks-filter {text!r} must be local ranks joined by commas (0,1,3)")
    return frozenset(int(p) for p in parts)


def job_name(args: RunArgs) -> str:
    """``--rdzv-id`` as it is when it is a job name; else one made from the script's or module's name."""
    if args.rdzv_id:
        if not JOB_NAME_RE.fullmatch(args.rdzv_id):
            raise CtlError(f"--rdzv-id {args.rdzv_id!r} is the job's name here: 1-63 characters of a-z, 0-9 and "
                           "'-', starting and ending with a letter or digit")
        return args.rdzv_id
    stem = args.target.rsplit(".", 1)[-1] if args.module else Path(args.target).stem
    name = re.sub(r"[^a-z0-9-]+", "-", stem.lower()).strip("-")[:63].strip("-")
    return name or "run"


def _entry(args: RunArgs) -> dict[str, Any]:
    if args.no_python:
        raise CtlError("--no-python: rankctl runs Python in every rank (a script or -m module); "
                       "an executable that is not Python cannot join the job's groups")
    if args.module:
        return {"module": args.target}
    script = (args.workdir / os.path.expanduser(args.target)).resolve()
    if script.is_dir():
        raise CtlError(f"script {args.target!r} is a directory ({script}), not a Python file: give the script in it "
                       f"(e.g. {args.target.rstrip('/')}/train.py), or -m for a package with a __main__")
    if not script.is_file():
        raise CtlError(f"script {args.target!r} not found: no file {script}")
    try:
        inside = script.relative_to(args.workdir.resolve())
    except ValueError:
        raise CtlError(f"script {args.target!r} ({script}) is outside the working directory {args.workdir}, "
                       "which ctl run ships to the nodes: run it from the project's directory or give --workdir") \
            from None
    return {"entrypoint": inside.as_posix()}


def environment(given: tuple[str, ...], here: dict[str, str] | None = None) -> dict[str, str]:
    """``--env NAME=VALUE`` or ``--env NAME`` (its value here): what every rank gets in ``python.env``."""
    here = dict(os.environ) if here is None else here
    out = {}
    for item in given:
        name, sep, value = item.partition("=")
        if not sep:
            if name not in here:
                raise CtlError(f"--env {name}: not set here (give --env {name}=VALUE)")
            value = here[name]
        out[name] = value
    return out


def job_document(args: RunArgs, slots: int) -> dict[str, Any]:
    """The job file ``ctl run`` submits (``--dry-run`` prints it)."""
    least, most = node_range(args.nnodes)
    resources: dict[str, Any] = {"nodes": most, "slots_per_node": slots}
    if least < most:
        resources["min_nodes"] = least
    python = {**_entry(args), "args": list(args.args), "workdir": str(args.workdir.resolve())}
    if args.env:
        python["env"] = environment(args.env)
    doc = {"name": job_name(args), "kind": "python", "resources": resources,
           "restart": {"max_restarts": args.max_restarts}, "python": python}
    if args.parallel:
        doc["parallel"] = dict(args.parallel)
    return doc


def layout_line(spec: Any) -> str:
    """The layout the job runs, as ``ctl run`` says it: ``tp=2 pp=1 cp=1 ep=1 dp=2`` (its spec, ``--set`` included)."""
    par, res = spec.parallel, spec.resources
    world, model = res.nodes * res.slots_per_node, par.tp * par.pp * par.cp
    etp = f" etp={par.etp}" if par.etp else ""
    return f"tp={par.tp} pp={par.pp} cp={par.cp} ep={par.ep}{etp} dp={world // model if world % model == 0 else '?'}"


class _Quoted(str):
    """A value written in quotes."""


def _quoted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _quoted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_quoted(v) for v in value]
    return _Quoted(value) if isinstance(value, str) else value


def job_yaml(doc: dict[str, Any], command: str) -> str:
    """The job file's text, headed by the command it stands for. Every string value is quoted: a script's
    ``3e-4`` or ``yes`` stays the text it was on the command line."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(_Quoted, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", str(s), style='"'))
    head = "# ctl run " + " ".join(command.splitlines()) + "\n"
    return head + yaml.dump(_quoted(doc), Dumper=Dumper, sort_keys=False, default_flow_style=False,
                            allow_unicode=True)
