"""The corpus of real training patterns the hang judgement is tried on (issue 52): healthy pauses that must never be
killed, and true hangs that must be named and acted on by the rule (``coordinator.diagnosis.pace``).

One script, ``SCRIPT``, runs as a rank of a ``kind: python`` job in two modes: ``report`` (it calls
``rankctl.context()`` and reports its steps, as every ``train`` job does) and ``plain`` (a torchrun script that never
calls rankctl). Its first argument is the mode, its second a directory for markers (``pause-STEP-RANK``: when a
pause began, epoch seconds; ``external-RANK``: it reached the phase in which the test applies its outside faults,
which ends when ``external-done`` exists), its third the case. Used by ``tests/e2e/test_e2e_hang_corpus.py`` and
``bench/hangs.py``.
"""

from __future__ import annotations

SCRIPT = r'''
import gc, os, pickle, queue, subprocess, sys, threading, time
import torch
import torch.distributed as dist

MODE, MARKS, CASE = sys.argv[1], sys.argv[2], sys.argv[3]
if MODE == "report":
    import rankctl
    ctx = rankctl.context()
    rank, group = ctx.rank, ctx.group("world")
    def say(step): ctx.report(step, loss=1.0 / step)
else:
    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), None
    def say(step): pass


def mark(name, text=""):
    with open(os.path.join(MARKS, f"{name}-{rank}"), "w") as f:
        f.write(text)


def warm_up(seconds):                        # a first step that compiles for long
    time.sleep(seconds)

def save_checkpoint(seconds):                # rank 0 writes to slow storage: blocked in I/O
    time.sleep(seconds)

def pickle_state(seconds):                   # CPU-bound pickling, in Python, holding the GIL
    state = [{"w": list(range(200))} for _ in range(2000)]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pickle.dumps(state)

def save_fsync(seconds):                     # torch.save with fsync
    t, path, end = torch.randn(2_000_000), os.path.join(MARKS, f"ckpt-{rank}.pt"), time.monotonic() + seconds
    while time.monotonic() < end:
        with open(path, "wb") as f:
            torch.save(t, f)
            f.flush()
            os.fsync(f.fileno())

def loader_event(seconds):                   # a data-loader thread that is late
    ready = threading.Event()
    threading.Timer(seconds, ready.set).start()
    ready.wait()

def loader_queue(seconds):
    batches = queue.Queue()
    threading.Timer(seconds, batches.put, (1,)).start()
    batches.get()

def loader_worker(seconds):                  # a worker subprocess produces the batch
    subprocess.run([sys.executable, "-c", f"import time; time.sleep({seconds})"], check=True)

def evaluate(seconds):                       # compute, then I/O, then Python
    a, end = torch.randn(128, 128), time.monotonic() + seconds / 3
    while time.monotonic() < end:
        a = torch.tanh(a @ a)
    time.sleep(seconds / 3)
    end = time.monotonic() + seconds / 3
    while time.monotonic() < end:
        sum(i * i for i in range(10000))

def gc_pause(_):                             # a full collection of a large cyclic heap
    junk = []
    for _ in range(400000):
        d = {}
        d["self"] = d
        junk.append(d)
    del junk
    gc.collect()

def stuck_loop(_):                           # true hangs: an endless Python loop ...
    while True:
        pass

def stuck_lock(_):                           # ... a lock never released
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()


HEALTHY = {1: {0: (warm_up, 20)}, 8: {0: (save_checkpoint, 8)}, 14: {0: (pickle_state, 8)},
           20: {0: (save_fsync, 5)}, 26: {1: (loader_event, 8)}, 32: {1: (loader_queue, 8)},
           38: {1: (loader_worker, 8)}, 44: {0: (evaluate, 12), 1: (evaluate, 6)}, 50: {0: (gc_pause, 0)},
           56: {0: (save_checkpoint, 30)}}
HANGS = {"loop": {8: {1: (stuck_loop, 0)}}, "lock": {8: {1: (stuck_lock, 0)}}}
pauses = HEALTHY if CASE == "healthy" else HANGS.get(CASE, {})
last = 62 if CASE == "healthy" else 1000
step = 0
while step < last:
    step += 1
    what, seconds = pauses.get(step, {}).get(rank, (None, 0))
    if what is not None:
        mark(f"pause-{step}", str(time.time()))
        what(seconds)
    x = torch.ones(4) * step
    if CASE == "mismatch" and step == 8:
        mark(f"pause-{step}", str(time.time()))
        if rank == 0:
            dist.all_reduce(x, group=group)  # rank 0 in all_reduce, rank 1 in barrier: they never match
        else:
            dist.barrier(group=group)
    dist.all_reduce(x, group=group)
    say(step)
    time.sleep(0.05)
    if step == last - 1 and CASE == "healthy":
        mark("external")                     # the test throttles, suspends and traces the ranks now
        done = torch.zeros(1)
        while not done[0]:                   # every rank leaves together
            done[0] = float(os.path.exists(os.path.join(MARKS, "external-done")))
            dist.all_reduce(done, op=dist.ReduceOp.MAX, group=group)
            time.sleep(0.05)
    if step == 6 and CASE == "stopped":
        mark("stop-me")
        while True:                          # the test stops rank 1 for good: the others wait in the all-reduce
            dist.all_reduce(x, group=group)
            time.sleep(0.05)
'''

JOB = """
name: {name}
kind: python
resources: {{nodes: 1, slots_per_node: 2}}
backend: gloo
restart: {{max_restarts: 0{timeout}}}
python: {{entrypoint: corpus.py, workdir: {workdir}, args: [{mode}, {marks}, {case}]}}
"""

HEALTHY_PAUSES = {8: "save_checkpoint", 14: "pickle_state", 20: "save_fsync", 26: "loader_event",
                  32: "loader_queue", 38: "loader_worker", 44: "evaluate", 56: "save_checkpoint"}
