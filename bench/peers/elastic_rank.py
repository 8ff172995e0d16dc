"""A rank under torchrun or NVRx ``ft_launcher`` for ``bench/peers.py``: torch and nvidia-resiliency-ext only.

    torchrun ... bench/peers/elastic_rank.py OUT [plain|ft|ft-calc-at-N]

Builds the default gloo group from the launcher's environment and runs ``workload.loop``. ``ft``: a
``RankMonitorClient`` connects to the launcher's rank monitor and sends one heartbeat each step; ``ft-calc-at-N``
also calls ``calculate_and_set_hb_timeouts()`` after step N (NVRx's heartbeat integration guide, step 4: once a
sufficient range of heartbeat intervals has been observed), every attempt again (no checkpoint keeps them).
"""

import time

STARTED = time.time()

import os  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist  # noqa: E402

import workload  # noqa: E402


def main() -> None:
    out, mode = sys.argv[1], (sys.argv[2:] or ["plain"])[0]   # positional: ft_launcher takes any --ft... prefix
    calc_at = int(mode.rsplit("-", 1)[1]) if mode.startswith("ft-calc-at-") else 0
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    status = workload.Status(out, rank, STARTED, restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                             group=int(os.environ.get("GROUP_RANK", 0)))
    each = None
    if mode != "plain":
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        client = RankMonitorClient()
        client.init_workload_monitoring()

        def each(step: int, _value: float) -> None:
            client.send_heartbeat()
            if step == calc_at:
                client.calculate_and_set_hb_timeouts()
                if rank == 0:
                    print(f"heartbeat timeouts calculated at step {step}: {client.hb_timeouts}", flush=True)
    workload.loop(lambda t: dist.all_reduce(t), status, each=each)


if __name__ == "__main__":
    main()
