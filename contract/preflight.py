"""How a pre-flight's figures read (``runtime.preflight`` measures, the coordinator keeps them, ``ctl status``
and the job's event show them): one line, torch-free."""

from __future__ import annotations

from typing import Mapping

from rankctl.contract.spec import DEFAULT_ORDER


def line(ms: Mapping[str, float], note: str = "") -> str:
    """``all-reduce tp 0.21 ms, dp 0.40 ms; links 0.10 ms one way (slowest 0.20 ms); GPUs: ...``: each group
    kind's slowest rank's median all-reduce, the nodes' one-way delays, the note (GPU facts, slowest node)."""
    order = DEFAULT_ORDER.split("-")   # one order whatever the figures' (a protobuf map has none)
    named = sorted((k for k in ms if not k.startswith("link_")),
                   key=lambda k: (order.index(k) if k in order else len(order), k))
    kinds = ", ".join(f"{k} {ms[k]:.2f} ms" for k in named)
    links = (f"links {ms['link_median']:.2f} ms one way (slowest {ms['link_max']:.2f} ms)"
             if "link_median" in ms and "link_max" in ms else "")
    return "; ".join(x for x in (kinds and f"all-reduce {kinds}", links, note) if x)
