"""A python job that uses CUDA (bench/gpu_check.sh): in a rank forked by the warm launcher, torch sees the GPU,
an all-reduce over rankctl's world group runs on it, and a bf16 matmul's result matches fp32's."""

import torch
import torch.distributed as dist

import rankctl

ctx = rankctl.context()
want_cuda = ctx.backend == "nccl"
if want_cuda and not torch.cuda.is_available():
    raise SystemExit("rank sees no CUDA device although the job asked for nccl")
device = ctx.device
x = torch.full((1024,), float(ctx.rank + 1), device=device)
dist.all_reduce(x, group=ctx.group("world"))
assert x[0].item() == sum(r + 1 for r in range(ctx.world_size)), x[0].item()
a = torch.randn(2048, 2048, device=device)
ref = a @ a
got = (a.to(torch.bfloat16) @ a.to(torch.bfloat16)).float()
err = ((got - ref).norm() / ref.norm()).item()
assert err < 2e-2, err
name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
print(f"rank {ctx.rank}: device {device} ({name}), backend {ctx.backend}, bf16 matmul rel err {err:.2e}")
ctx.report(1, loss=err)
