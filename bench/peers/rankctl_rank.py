"""A rank of rankctl's ``kind: python`` job for ``bench/peers.py``: the shared workload on ``rankctl.context()``'s
world group, with ``ctx.report`` each step (what the job's ``ctl status`` shows). Runs as ``__main__`` inside the
job's shipped workdir (this file and ``workload.py``)."""

import time

STARTED = time.time()

import sys  # noqa: E402

import torch.distributed as dist  # noqa: E402

import rankctl  # noqa: E402
import workload  # noqa: E402   (the workdir: the python kind puts the script's directory first on sys.path)

ctx = rankctl.context()
world = ctx.group("world")
status = workload.Status(sys.argv[1], ctx.rank, STARTED, attempt=ctx.attempt)
workload.loop(lambda t: dist.all_reduce(t, group=world), status, each=lambda step, value: ctx.report(step, loss=value))
