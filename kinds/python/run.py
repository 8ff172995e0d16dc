"""The ``python`` kind's rank entry: the user's script or function, in torchrun's environment.

The runtime does not rendezvous for this kind (``JobKind.own_rendezvous``): ``MASTER_ADDR:MASTER_PORT`` is the
assignment's rendezvous address, free on rank 0's node, so an unmodified script's
``init_process_group("gloo")`` (``env://``) hosts its TCPStore there on rank 0. ``rankctl.context()`` uses
that default group, or creates it at the same address if the script never did (``runtime.context``).
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
from typing import Any

from rankctl.kinds.context import RankContext, RankExit
from rankctl.kinds.python.checks import is_function


def torchrun_env(ctx: RankContext) -> dict[str, str]:
    """What torchrun sets for a worker (``RANK`` ... ``MASTER_PORT``), from the rank's assignment."""
    a = ctx.assignment
    return {
        "RANK": str(a.rank), "LOCAL_RANK": str(a.local_rank), "WORLD_SIZE": str(a.world_size),
        "LOCAL_WORLD_SIZE": str(ctx.local_world_size), "GROUP_RANK": str(ctx.node_index),
        "MASTER_ADDR": a.rendezvous_host, "MASTER_PORT": str(a.rendezvous_port),
    }


def _script_path(entrypoint: str, workdir: str | None) -> str:
    path = os.path.abspath(os.path.join(workdir or os.getcwd(), os.path.expanduser(entrypoint)))
    if os.path.isdir(path):
        raise IsADirectoryError(f"python.entrypoint {entrypoint!r} is a directory ({path}), not a Python file")
    if not os.path.isfile(path):
        where = f"workdir {workdir}" if workdir else f"the rank's directory {os.getcwd()}"
        raise FileNotFoundError(f"python.entrypoint {entrypoint!r} not found: no file {path} (relative to {where})")
    return path


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr, flush=True)  # sys.exit("message"), as the interpreter does
    return 1


def _call(entrypoint: str, module: str, args: list[str], workdir: str | None) -> None:
    """Run the script as ``__main__`` (``python script.py args``), the module (``python -m module args``), or
    import and call the function."""
    if module:
        sys.argv = [module, *args]   # runpy puts the module's file in argv[0], as python -m does
        sys.path.insert(0, workdir or os.getcwd())
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    if is_function(entrypoint):
        sys.argv = [entrypoint, *args]
        sys.path.insert(0, workdir or os.getcwd())
        module, _, name = entrypoint.partition(":")
        getattr(importlib.import_module(module), name)()
        return
    path = _script_path(entrypoint, workdir)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(path))
    runpy.run_path(path, run_name="__main__")


def run(ctx: RankContext) -> dict[str, Any]:
    """The ``python`` job kind: exit 0 (or return) is success; an exception or a non-zero exit fails the rank."""
    cfg = ctx.spec.python
    os.environ.update(torchrun_env(ctx))
    os.environ.update(cfg.env)
    workdir = ctx.assignment.workdir or cfg.workdir  # the node's extracted copy of a shipped workdir
    if workdir:
        if not os.path.isdir(workdir):
            raise FileNotFoundError(f"python.workdir {workdir!r} is not a directory on node {ctx.node}")
        os.chdir(workdir)
    ctx.log.info("python", entrypoint=cfg.entrypoint, module=cfg.module, args=len(cfg.args), workdir=workdir)
    try:
        _call(cfg.entrypoint, cfg.module, list(cfg.args), workdir)
    except SystemExit as exc:
        code = _exit_code(exc)
        if code != 0:
            what = f"-m {cfg.module}" if cfg.module else cfg.entrypoint
            raise RankExit(code, f"{what} exited with code {code}") from None
    return ctx.reported()

