"""Megatron-Core's parallel state on rankctl's groups (examples/megatron-core.yaml).

``rankctl.megatron.initialize_model_parallel()`` (ctx defaults to ``rankctl.context()``) fills
``megatron.core.parallel_state``; then all-reduces over Megatron's own getters must give the sums
``ctx.ranks(kind)`` predicts, and Megatron's tensor-parallel f and g mappings run forward and backward over gloo on CPU (its
all-gather mappings allocate on CUDA, so they are left out).
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

import rankctl
import rankctl.megatron


def check_getters(ctx) -> dict[str, float]:
    getters = {
        "tp": ps.get_tensor_model_parallel_group, "pp": ps.get_pipeline_model_parallel_group,
        "dp": ps.get_data_parallel_group, "mp": ps.get_model_parallel_group,
        "tp_dp": lambda: ps.get_tensor_and_data_parallel_group(),
    }
    sums = {}
    for kind, getter in getters.items():
        group, members = getter(), ctx.ranks(kind)
        if dist.get_process_group_ranks(group) != members:
            raise AssertionError(f"rank {ctx.rank}: Megatron's {kind} group is {dist.get_process_group_ranks(group)}, "
                                 f"rankctl's {members}")
        x = torch.tensor([float(ctx.rank + 1)])
        dist.all_reduce(x, group=group)
        if x.item() != sum(r + 1 for r in members):
            raise AssertionError(f"rank {ctx.rank}: {kind} all-reduce gave {x.item()}")
        sums[kind] = x.item()
    return sums


def check_tp_mappings(ctx) -> None:
    """Megatron's f (copy forward, all-reduce backward) and g (all-reduce forward, copy backward) over gloo."""
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    x = torch.full((2, 3), float(tp_rank + 1), requires_grad=True)
    y = reduce_from_tensor_model_parallel_region(copy_to_tensor_model_parallel_region(x))
    if not torch.equal(y, torch.full((2, 3), tp_size * (tp_size + 1) / 2)):
        raise AssertionError(f"rank {ctx.rank}: g(f(x)) gave {y.flatten().tolist()}")
    y.backward(torch.ones(2, 3))  # g's backward copies the ones, f's all-reduces them over tp (in place:
    # Megatron's _reduce all-reduces grad.contiguous(), so an expanded gradient such as sum()'s would stay 1)
    if not torch.equal(x.grad, torch.full((2, 3), float(tp_size))):
        raise AssertionError(f"rank {ctx.rank}: f's backward gave {x.grad.flatten().tolist()}")


def main() -> None:
    ctx = rankctl.context()
    rankctl.megatron.initialize_model_parallel()
    sums = check_getters(ctx)
    check_tp_mappings(ctx)
    print(f"rank {ctx.rank}: tp rank {ps.get_tensor_model_parallel_rank()}, pp rank "
          f"{ps.get_pipeline_model_parallel_rank()}, dp rank {ps.get_data_parallel_rank()}; "
          f"all-reduce sums over Megatron's groups ok {sums}; tp mappings ok", flush=True)
    ps.destroy_model_parallel()


if __name__ == "__main__":
    main()
