"""Megatron-Core on rankctl's groups (examples/megatron-core.yaml), both ways Megatron takes them.

``rankctl.megatron.process_groups()`` returns Megatron-Core's ``ProcessGroupCollection`` of this rank's groups with
nothing global set (Megatron's direction: ``pg_collection=``); a tensor-parallel MLP of Megatron's own
``ColumnParallelLinear`` and ``RowParallelLinear`` built on its ``tp`` group must give the serial MLP's output and
input gradient on CPU. Then ``rankctl.megatron.initialize_model_parallel()`` (ctx defaults to ``rankctl.context()``)
fills ``megatron.core.parallel_state``; all-reduces over Megatron's own getters must give the sums
``ctx.ranks(kind)`` predicts, and Megatron's tensor-parallel f and g mappings run forward and backward over gloo on CPU
(its all-gather mappings allocate on CUDA, so they are left out).
"""

import warnings

# Megatron-Core on CPU: its notes that Transformer Engine and Apex are not installed and its CUDA tuning hint say
# nothing about this example; left on, they bury its output (40 lines of 8 ranks). A user's own job keeps them.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)
warnings.filterwarnings("ignore", message="When using async grad allreduce", category=UserWarning)

import torch  # noqa: E402 - after the filters: Megatron warns on import
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: E402
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.tensor_parallel.mappings import (  # noqa: E402
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

import rankctl  # noqa: E402
import rankctl.megatron  # noqa: E402


def gathered(weight: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(weight) for _ in range(group.size())]
    dist.all_gather(parts, weight.detach(), group=group)
    return torch.cat(parts, dim)


def check_collection_mlp(ctx, pgc) -> float:
    """Megatron's column- then row-parallel linear on the collection's tp group against the same MLP in one piece."""
    for kind in ("tp", "dp", "mp"):
        if dist.get_process_group_ranks(getattr(pgc, kind)) != ctx.ranks(kind):
            raise AssertionError(f"rank {ctx.rank}: the collection's {kind} group is not rankctl's")
    config = ModelParallelConfig(tensor_model_parallel_size=pgc.tp.size(), use_cpu_initialization=True)
    torch.manual_seed(0)   # the full weights, then each rank's slice (use_cpu_initialization)

    def init(w: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(w, std=0.5)

    up = ColumnParallelLinear(8, 16, config=config, init_method=init, bias=False, gather_output=False, tp_group=pgc.tp)
    down = RowParallelLinear(16, 8, config=config, init_method=init, bias=False, input_is_parallel=True,
                             skip_bias_add=True, tp_group=pgc.tp)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y, _ = down(torch.relu(up(x)[0]))
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = torch.relu(x_ref @ gathered(up.weight, 0, pgc.tp).T) @ gathered(down.weight, 1, pgc.tp).T
    y.sum().backward()
    y_ref.sum().backward()
    error = max((y - y_ref).abs().max().item(), (x.grad - x_ref.grad).abs().max().item())
    if error > 1e-5:
        raise AssertionError(f"rank {ctx.rank}: the tensor-parallel MLP differs from the serial one by {error}")
    return error


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
    pgc = rankctl.megatron.process_groups()   # nothing global yet
    error = check_collection_mlp(ctx, pgc)
    print(f"rank {ctx.rank}: ProcessGroupCollection tp {dist.get_process_group_ranks(pgc.tp)}, dp "
          f"{dist.get_process_group_ranks(pgc.dp)}; Megatron's parallel MLP on it matches the serial one "
          f"(max error {error:.1e})", flush=True)
    rankctl.megatron.initialize_model_parallel()
    sums = check_getters(ctx)
    check_tp_mappings(ctx)
    print(f"rank {ctx.rank}: tp rank {ps.get_tensor_model_parallel_rank()}, pp rank "
          f"{ps.get_pipeline_model_parallel_rank()}, dp rank {ps.get_data_parallel_rank()}; "
          f"all-reduce sums over Megatron's groups ok {sums}; tp mappings ok", flush=True)
    ps.destroy_model_parallel()


if __name__ == "__main__":
    main()
