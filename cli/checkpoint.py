"""``ctl checkpoint``: work with training checkpoints."""

from __future__ import annotations

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
              help="Where to write the full state_dict (torch.save).")
@json_option
def export(step_dirs: tuple[str, ...], out: Path, as_json: bool) -> None:
    """Gather one step's shards (STEP_DIRS: its directory, or one per node) into one full
    state_dict that loads into the serial model and re-slices into any other layout.
    With --json: {"out", "tensors", "parameters"} on stdout."""
    import torch

    from rankctl.kinds.train.checkpoint import export_full_state_dict

    try:
        full = export_full_state_dict(list(step_dirs))
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise CtlError(f"cannot export {', '.join(step_dirs)}: {exc}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(full, out)
    params = sum(t.numel() for t in full.values())
    if as_json:
        from rankctl.cli.console import print_json

        print_json({"out": str(out), "tensors": len(full), "parameters": params})
    else:
        click.echo(f"wrote {out}: {len(full)} tensors, {params:,} parameters", err=True)
