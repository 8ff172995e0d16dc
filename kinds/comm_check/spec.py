"""The ``comm-check`` kind's spec section: ``comm_check``."""

from __future__ import annotations

from pydantic import Field, StrictFloat, StrictInt

from rankctl.contract import limits as L
from rankctl.contract.spec import Section


class CommCheckSpec(Section):
    """A check of every group of the layout: collectives timed over each, bus bandwidth reported per group."""

    size_bytes: StrictInt = Field(1 << 20, ge=4, le=L.MAX_COMM_BYTES)
    """Bytes of each collective's tensor."""
    iters: StrictInt = Field(5, ge=1, le=L.MAX_COMM_ITERS)
    """Timed repetitions of each collective."""
    warmup: StrictInt = Field(2, ge=0, le=L.MAX_COMM_WARMUP)
    """Untimed repetitions before the timed ones."""
    duration: StrictFloat = Field(0.0, ge=0, le=L.MAX_SOAK_S)
    """A soak: repeat the check for this many seconds (0: once)."""
