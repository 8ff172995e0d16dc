"""The ``comm-check`` kind's spec section: ``comm_check``."""

from __future__ import annotations

from pydantic import Field, StrictFloat, StrictInt

from rankctl.contract import limits as L
from rankctl.contract.spec import Section


class CommCheckSpec(Section):
    size_bytes: StrictInt = Field(1 << 20, ge=4, le=L.MAX_COMM_BYTES)
    iters: StrictInt = Field(5, ge=1, le=L.MAX_COMM_ITERS)
    warmup: StrictInt = Field(2, ge=0, le=L.MAX_COMM_WARMUP)
    duration: StrictFloat = Field(0.0, ge=0, le=L.MAX_SOAK_S)  # soak: repeat the check this many seconds
