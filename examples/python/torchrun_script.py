"""An unmodified torchrun script: it runs the same under `torchrun --nproc-per-node 4 torchrun_script.py`
and as a rankctl `kind: python` job (examples/python-torchrun.yaml)."""

import argparse
import os

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=float, default=1.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.tensor([args.scale * (rank + 1)])
    dist.all_reduce(x)
    expected = args.scale * world * (world + 1) / 2
    print(f"rank {rank}/{world} (local {os.environ['LOCAL_RANK']}/{os.environ['LOCAL_WORLD_SIZE']}, "
          f"node {os.environ['GROUP_RANK']}, master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}): "
          f"all_reduce sum {x.item():g}, expected {expected:g}; {os.environ.get('GREETING', '')}", flush=True)
    if x.item() != expected:
        raise SystemExit(f"rank {rank}: all_reduce gave {x.item()}, expected {expected}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
