"""rankctl: a control plane for Megatron-style parallel training.

For code that runs in a rank (a ``kind: python`` job): ``ctx = rankctl.context()`` gives the rank its
``RankContext`` (rank, world size, coordinates, layout, ``ranks(kind)``, ``group(kind)``,
``report(step, loss=..., **metrics)``, ``checkpoint_dir``). Importing ``rankctl`` loads no torch.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rankctl.runtime.context import RankContext

__all__ = ["context"]

_RUNTIME = "rankctl.runtime.context"


def context() -> "RankContext":
    """This rank's context; outside a rank that rankctl started, a ``RuntimeError`` that says so."""
    runtime = sys.modules.get(_RUNTIME)  # loaded in every rank; never imported (nor torch) just to say no
    ctx = runtime.current() if runtime is not None else None
    if ctx is None:
        raise RuntimeError(
            "rankctl.context() is only available inside a rank that rankctl started "
            "(a job run by `ctl submit`/`ctl up`, e.g. kind: python); this process is not one")
    return ctx
