"""A rank of the hang corpus (``tests/e2e/hangcorpus.py``) under torchrun or NVRx ``ft_launcher``, for
``bench/hangs.py``: torch and nvidia-resiliency-ext only.

    torchrun ... bench/peers/corpus_rank.py plain|ft|ft-calc-at-N MODE MARKS CASE

Writes ``MARKS/pid-RANK`` (its pid: the bench's handle on the rank), then runs the corpus ``SCRIPT`` as ``__main__``
with ``MODE MARKS CASE``. ``ft``: each ``torch.distributed.all_reduce`` the script calls (one a step, as in
``bench/peers/elastic_rank.py``) is followed by an NVRx heartbeat; ``ft-calc-at-N`` also calls
``calculate_and_set_hb_timeouts()`` after the N-th (NVRx's heartbeat guide: once a range of intervals was seen).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "e2e"))

import torch.distributed as dist  # noqa: E402

from hangcorpus import SCRIPT  # noqa: E402   (text only: it imports nothing of rankctl)


def heartbeats(calc_at: int) -> None:
    """Wrap ``dist.all_reduce``: a heartbeat after each call of the script's (the client starts at the first)."""
    real, state = dist.all_reduce, {"n": 0, "client": None, "inside": False}

    def all_reduce(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if state["inside"]:   # NVRx's own synchronisation all-reduces too
            return real(*args, **kwargs)
        if state["client"] is None:
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

            state["client"] = RankMonitorClient()
            state["client"].init_workload_monitoring()
        out = real(*args, **kwargs)
        client, state["n"], state["inside"] = state["client"], state["n"] + 1, True
        try:
            client.send_heartbeat()
            if state["n"] == calc_at:
                client.calculate_and_set_hb_timeouts()
                if dist.get_rank() == 0:
                    print(f"heartbeat timeouts calculated after all-reduce {calc_at}: {client.hb_timeouts}",
                          flush=True)
        finally:
            state["inside"] = False
        return out

    dist.all_reduce = all_reduce


def main() -> None:
    hb, mode, marks, case = sys.argv[1:5]
    Path(marks, f"pid-{os.environ['RANK']}").write_text(str(os.getpid()))
    if hb != "plain":
        heartbeats(int(hb.rsplit("-", 1)[1]) if hb.startswith("ft-calc-at-") else 0)
    sys.argv = ["corpus.py", mode, marks, case]
    exec(compile(SCRIPT, "corpus.py", "exec"), {"__name__": "__main__", "__file__": "corpus.py"})  # noqa: S102


if __name__ == "__main__":
    main()
