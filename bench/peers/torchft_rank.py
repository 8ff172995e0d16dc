"""A replica group of one rank under torchft for ``bench/peers.py``: torch and torchft only.

    python bench/peers/torchft_rank.py OUT REPLICA LIGHTHOUSE MIN_REPLICAS

Each step: ``manager.start_quorum()``, ``manager.allreduce`` of the workload's tensor (torchft's fault-tolerant
all-reduce across the replica groups of the quorum; not its DDP wrapper), the workload's sleep, then
``manager.should_commit()``; the status line carries the outcome (``ok``), the quorum id and its participants, and
``step`` is the manager's committed step count (a replacement takes it from a survivor when it heals). Everything on
loopback: this group's TCPStore, the manager's gRPC server (torchft binds ``[::]``: the wrapper below binds
127.0.0.1) and the checkpoint HTTP server (its address is built from ``socket.gethostname()``: 127.0.0.1 here).
"""

import time

STARTED = time.time()

import os  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
socket.gethostname = lambda: "127.0.0.1"   # noqa: E731 - before torchft reads it

import torch  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402

import torchft.manager as ft_manager  # noqa: E402
from torchft import Manager, ProcessGroupGloo  # noqa: E402

import workload  # noqa: E402

_SERVER = ft_manager.ManagerServer


def _loopback_server(**kwargs):  # noqa: ANN003, ANN202
    return _SERVER(**{**kwargs, "bind": "127.0.0.1:0"})


ft_manager.ManagerServer = _loopback_server


def main() -> None:
    out, replica, lighthouse, min_size = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)   # the group's own store (one rank)
    state = {"w": torch.zeros(4)}
    manager = Manager(pg=ProcessGroupGloo(), load_state_dict=state.update, state_dict=lambda: dict(state),
                      min_replica_size=min_size, rank=0, world_size=1, store_addr="127.0.0.1",
                      store_port=store.port, lighthouse_addr=lighthouse, replica_id=f"replica_{replica}",
                      hostname="127.0.0.1")
    status = workload.Status(out, replica, STARTED)
    while True:
        manager.start_quorum()
        t = workload.tensor(manager.current_step() + 1)
        manager.allreduce(t).wait()
        time.sleep(workload.STEP_S)
        ok = manager.should_commit()
        status.write(manager.current_step(), ok=ok, quorum=manager._quorum_id, n=manager.num_participants())


if __name__ == "__main__":
    main()
