"""Comparing a parallel run's final parameters with the serial run's, after AdamW steps.

Why not plain 1e-5 on every element: an element whose gradient is a cancellation below
AdamW's eps (1e-8) gets the update ``lr * g / (|g| + eps) ~ lr * g / eps``: a gain of
``lr / eps`` (1.5e5 at step 1 of ``test_e2e_parallel``) on the gradient's fp32 rounding, which
every layout sums in its own order. ``bench/adam_drift.py`` shows it for
``layers.2.mlp.proj.weight[0, 72]``: step-1 gradient -1.45e-10 (its tensor's others ~1e-4),
cp2 differs from serial by 2.6e-11, the step-1 update by 3.8e-6, and from step 2 on the
gradients are ~2e-4 >> eps, the updates agree to 1e-8 and that offset just stays. CI saw
1.38e-5, i.e. a rounding difference of ~1e-10 in that one gradient. Losses cannot see it.

What Adam can do to such an element: torch's AdamW updates
``p <- p (1 - lr_t wd) - lr_t / bc1_t * m_t / (sqrt(v_t / bc2_t) + eps)`` with
``m_t = (1-b1) sum_k b1^(t-k) g_k``, ``v_t = (1-b2) sum_k b2^(t-k) g_k^2``, ``bc_i = 1 - b_i^t``.
Cauchy-Schwarz on ``m_t`` against ``v_t`` gives, whatever the gradients,
``|update_t| <= lr_t * A_t``, ``A_t = (1-b1)/sqrt(1-b2) * sqrt(bc2_t)/bc1_t * sqrt((1-r^t)/(1-r))``,
``r = b1^2/b2`` (``A_1 = 1``, ``A_10 = 1.012`` for betas 0.9/0.95). Two runs from the same
parameters differ after T steps by at most ``sum_t 2 lr_t A_t`` (weight decay multiplies the
difference by ``1 - lr_t wd <= 1``): ``adam_drift_bound``, 3.3e-2 for the parallel test's
schedule. That is the bound for an element whose gradient is noise.

The check (``assert_params_close``): every element within 1e-5 (abs + rel) except at most
``MAX_NOISY`` elements of the whole model, each of which must be within ``adam_drift_bound``.
Why few: the parallel test's serial run has 49 elements whose ``sqrt(v_hat)`` ever falls
below eps (the train test's: 4), but a drift needs large summands as well; per layout 1-2
elements pass 1e-6 here, 1 passes 2.5e-6 (the one CI saw 3.6x larger). Why that still tests
the layout: layout errors act on a shard, a row or a whole tensor, at least 32 elements in
these models (a LayerNorm vector of hidden = 32), and a gradient error of relative size d
moves every element of its tensor by ~lr * d per step (Adam normalises it). A 1% direction
error in one LayerNorm bias's gradient puts 21 elements past 1e-5 with every loss within
1e-5; another seed puts 59177 (``bench/adam_drift.py --perturb``, ``--other-seed``).
"""

from __future__ import annotations

import math

import torch

from rankctl.kinds.train import optim

TOL = 1e-5  # elementwise rtol and atol for every element but the noisy ones
MAX_NOISY = 4  # elements of the whole model allowed past TOL (each still within adam_drift_bound)


def adam_step_bound(t: int, betas: tuple[float, float] = optim.BETAS) -> float:
    """``A_t``: the largest ``|update| / lr`` AdamW can make at step ``t`` (1-based), any gradients."""
    b1, b2 = betas
    r = b1 * b1 / b2
    return (1 - b1) / math.sqrt(1 - b2) * math.sqrt(1 - b2**t) / (1 - b1**t) * math.sqrt((1 - r**t) / (1 - r))


def lr_schedule(lr: float, warmup: int, steps: int) -> list[float]:
    """The learning rate of steps 1..steps, as the trainer sets it."""
    return [optim.lr_at(s, lr=lr, warmup=warmup, steps=steps) for s in range(1, steps + 1)]


def adam_drift_bound(lrs: list[float]) -> float:
    """The most one element can differ between two AdamW runs from the same start (``lrs``:
    per-step learning rates): each step's updates are at most ``lr_t * A_t`` apart in sign."""
    return sum(2 * lr * adam_step_bound(t) for t, lr in enumerate(lrs, start=1))


def noisy_elements(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[tuple[str, tuple, float]]:
    """(name, index, |difference|) of every element past ``TOL`` (as ``torch.isclose`` counts it)."""
    out = []
    for name, want in ref.items():
        got = ours[name]
        assert got.shape == want.shape, (name, got.shape, want.shape)
        far = ~torch.isclose(got, want, rtol=TOL, atol=TOL)
        diff = (got - want).abs()
        out += [(name, tuple(int(i) for i in idx), float(diff[tuple(idx)])) for idx in far.nonzero()]
    return out


def assert_params_close(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], lrs: list[float]) -> None:
    """Final parameters of a layout against the serial run's (see the module docstring)."""
    assert ours.keys() == ref.keys(), sorted(set(ours) ^ set(ref))
    noisy, bound = noisy_elements(ours, ref), adam_drift_bound(lrs)
    worst = sorted(noisy, key=lambda e: -e[2])[:8]
    assert len(noisy) <= MAX_NOISY, f"{len(noisy)} elements differ by more than {TOL} (at most {MAX_NOISY} " \
                                    f"may, from Adam's eps amplifying rounding); largest: {worst}"
    assert all(d <= bound for *_, d in noisy), f"beyond what AdamW can do ({bound:.3e}): {worst}"
