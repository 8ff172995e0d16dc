"""Shared test set-up.

Several multi-rank tests fork ranks from the pytest process. A process whose OpenMP thread
pool has started cannot fork safely (the child waits for pool threads that do not exist), so
the test process runs torch single-threaded from the start: no pool is ever created. Ranks
set their own thread count after the fork, as the launcher's ranks do.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
