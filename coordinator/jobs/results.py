"""A job's result from its ranks' results: decoding here, aggregation by the job's kind.

Each kind declares its ``aggregate`` (``kinds.registry.JobKind``); a kind without one keeps
every rank's result under ``ranks``. Pure: a kind's aggregation never imports torch.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from rankctl.kinds import registry

AGGREGATE_ERROR_CHARS = 300   # of the exception's text, on the result


def parse_rank_results(raw: Mapping[int, str]) -> dict[int, Any]:
    """rank -> decoded result_json (empty or undecodable ones are left out)."""
    out: dict[int, Any] = {}
    for rank, text in raw.items():
        if not text:
            continue
        try:
            out[rank] = json.loads(text)
        except json.JSONDecodeError:
            out[rank] = {"unparseable": text[:200]}
    return out


def aggregate(kind: str, results: Mapping[int, Any]) -> dict[str, Any]:
    """The job result for ``kind`` from rank -> result. The ranks' results are what their processes wrote: a kind's
    aggregation that fails on them (a shape it does not expect) gives every rank's result and the error instead,
    never an exception in the coordinator's commit."""
    try:
        fn = registry.get(kind).resolve("aggregate")
    except ValueError:
        fn = None
    every = {"ranks": {str(r): results[r] for r in sorted(results)}}
    if fn is None:
        return every
    try:
        return fn(results)
    except Exception as exc:  # noqa: BLE001 - user processes' output: named on the result, never raised
        return {**every, "error": f"the {kind} kind could not aggregate its ranks' results: "
                                  f"{type(exc).__name__}: {str(exc)[:AGGREGATE_ERROR_CHARS]}"}
