"""``ctl checkpoint``: work with training checkpoints."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import click

from rankctl.cli.errors import CtlError
from rankctl.cli.options import SuggestingGroup, example, json_option


EXPORT_EXAMPLE = example("ctl checkpoint export ckpt/step-1000 --out full.pt")


@click.group("checkpoint", cls=SuggestingGroup, epilog=EXPORT_EXAMPLE)
def checkpoint() -> None:
    """Work with training checkpoints."""


@checkpoint.command("export", epilog=EXPORT_EXAMPLE)
@click.argument("step_dirs", nargs=-1, required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Where to write the full state_dict (torch.save), atomically: a new file, or an earlier export.")
@click.option("--force", is_flag=True, help="Replace whatever file or link is at --out (a link itself, never its target).")
@json_option
def export(step_dirs: tuple[str, ...], out: Path, force: bool, as_json: bool) -> None:
    """Gather one step's shards (STEP_DIRS: its directory, or one per node) into one full
    state_dict that loads into the serial model and re-slices into any other layout.
    With --json: {"out", "tensors", "parameters"} on stdout."""
    import torch

    from rankctl.kinds.train.checkpoint import atomic_write, export_full_state_dict

    if problem := out_problem(out, force):
        raise CtlError(problem)
    try:
        full = export_full_state_dict(list(step_dirs))
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise CtlError(f"cannot export {', '.join(step_dirs)}: {exc}") from None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(str(out), lambda f: torch.save(full, f))
    except OSError as exc:
        raise CtlError(write_failure(out, exc)) from None
    params = sum(t.numel() for t in full.values())
    if as_json:
        from rankctl.cli.view.console import print_json

        print_json({"out": str(out), "tensors": len(full), "parameters": params})
    else:
        click.echo(f"wrote {out}: {len(full)} tensors, {params:,} parameters", err=True)


def out_problem(out: Path, force: bool) -> str:
    """Why the export must not write ``out`` ("" when it may): something not a regular file is never replaced;
    a link, or a file that is not an earlier export, only with ``--force``."""
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        return f"--out {out}: {exc.strerror or exc}"
    if stat.S_ISLNK(st.st_mode):
        return "" if force else (f"--out {out} is a symbolic link (to {os.readlink(out)}): the export never writes "
                                 f"through a link; pass --force to replace the link itself with the file")
    if not stat.S_ISREG(st.st_mode):
        return f"--out {out} is not a regular file (a device, pipe or socket): the export writes a new file; name one"
    if force or is_export(out):
        return ""
    return f"--out {out} exists and is not a checkpoint export (a torch state dict of tensors): pass --force to replace it"


def is_export(path: Path) -> bool:
    """Whether ``path`` holds what an export writes: a torch state dict of tensors."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - anything unreadable as a state dict is not one
        return False
    return isinstance(state, dict) and bool(state) and all(isinstance(v, torch.Tensor) for v in state.values())


def write_failure(out: Path, exc: OSError) -> str:
    """One line: why ``out`` could not be written (nothing partial is left)."""
    why = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        why += f" (the file system of {out.parent} is full)"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why += f" ({out.parent} is not writable)"
    return f"cannot write --out {out}: {why}; nothing was written"
