"""The warm launcher's fork after ``import torch`` with CUDA present (bench/gpu_check.sh): the launcher asks
what hardware the node has exactly as ``ctl worker`` does, then forks; the child must still initialise CUDA
(a parent that initialised the CUDA driver would leave the child 'Cannot re-initialize CUDA in forked
subprocess')."""

import os
import sys

import torch

from rankctl.worker.launcher.main import hardware_facts

facts = hardware_facts()
print(f"launcher facts: gpu_count={facts['gpu_count']} gpus={facts['gpus']} torch={facts['torch']} cuda={facts['cuda']}")
print(f"parent initialised CUDA: {torch.cuda.is_initialized()}")
want_gpu = os.environ.get("GPU_CHECK_CPU") != "1"
if want_gpu and facts["gpu_count"] < 1:
    sys.exit("no GPU seen by the launcher's hardware facts")
pid = os.fork()
if pid == 0:
    try:
        if want_gpu:
            x = torch.randn(4096, 4096, device="cuda")
            torch.cuda.synchronize()
            print(f"forked child: CUDA ok on {torch.cuda.get_device_name(0)}, sum {float((x @ x).sum()):.3e}")
        else:
            print("forked child: CPU mode, no CUDA to initialise")
        os._exit(0)
    except Exception as exc:  # noqa: BLE001 - reported, then the child fails
        print(f"forked child: CUDA failed: {type(exc).__name__}: {exc}")
        os._exit(1)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
