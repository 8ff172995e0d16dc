"""A rank's result within what its report may carry: long loss lists are sampled, never the whole result dropped.

The coordinator keeps a rank's result up to ``RESULT_CHARS`` characters of JSON and replaces a longer one with a
note (``coordinator.model.rankbounds``): a 1,500-step job's per-step losses passed that and ``ctl status`` showed
none. ``result_json`` (the daemon, before it sends) keeps every loss while they fit, and otherwise every k-th one
(the first and the last always), saying so in ``losses_total`` and ``losses_every``.
"""

from __future__ import annotations

import json
from typing import Any

RESULT_CHARS = 65_536                   # a rank's result as JSON, at most
SAMPLED = ("losses", "val_losses")      # the lists that grow with the steps


def result_json(result: Any, limit: int = RESULT_CHARS) -> str:
    """``result`` as JSON of at most ``limit`` characters where sampling its step lists can make it so."""
    text = json.dumps(result)
    if len(text) <= limit or not isinstance(result, dict):
        return text
    lists = {k: v for k, v in result.items() if k in SAMPLED and isinstance(v, list) and len(v) > 2}
    every = 1
    while lists and len(text) > limit and every < max(len(v) for v in lists.values()):
        every *= 2
        out = {**result, **{k: _every(v, every) for k, v in lists.items()}}
        out["losses_total"] = {k: len(v) for k, v in lists.items()}
        out["losses_every"] = every
        text = json.dumps(out)
    return text


def _every(rows: list, k: int) -> list:
    """Every ``k``-th row, and the last."""
    kept = rows[::k]
    return kept if kept[-1] is rows[-1] else [*kept, rows[-1]]
