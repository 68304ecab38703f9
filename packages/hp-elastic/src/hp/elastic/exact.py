"""Exact mode: a gradient reduction whose result does not depend on the world size.

A float all-reduce of per-rank partial sums adds the same M micro-batch gradients in an order that
depends on W (which rank holds which, the ring's chunking), and float addition is not associative, so
the mean differs in the last bits from one W to another and training diverges bitwise after a scale
event. Exact mode makes the sum an **integer** sum, which is exact and associative:

1. every rank takes the max ``|g|`` over the elements of its micro-batch gradients (finite values
   only) and whether any element is NaN or inf; one ``all_reduce(MAX)`` of those three scalars gives
   the step's global max ``G`` and the non-finite flags. The set of micro-batches is the same at any W,
   so ``G`` is too. A non-finite element anywhere raises :class:`NonFiniteGradientError` on every rank
   (nothing is silently wrapped into the integers);
2. the shared power-of-two scale: ``2**shift`` with ``shift = K - E``, where ``G < 2**E``
   (``frexp``) and ``K = 62 - ceil(log2 M)``, so each quantized element has ``|q| <= 2**K`` and the sum
   of M of them ``|sum| <= 2**62`` fits int64 with a factor-2 headroom;
3. each micro-batch gradient is quantized ``q = round_half_even(g * 2**shift)`` (exact scaling in
   float64, then one rounding) and summed into an int64 accumulator on its rank;
4. ONE int64 ``all_reduce(SUM)`` over the group;
5. ``mean = float64(sum) * 2**-shift / M``, cast to the gradients' dtype: a fixed function of the
   integer sum, hence identical at every W.

Precision (float32 gradients): the quantum is ``2**(E-K)`` for the whole step, so an element keeps
``K + log2(|g| / G)`` significant bits relative to the step's max. With ``M <= 1024`` (``K >= 52``)
an element at the max keeps about K ≥ 52 bits (float32 has 24), every element with ``|g| >= G * 2**-28`` is quantized with no
error at all (its float32 ulp is a multiple of the quantum), smaller ones are rounded to an absolute
error ≤ ``2**(E-K-1)`` ≤ ``G * 2**-K`` (``< 2.3e-16 * G`` for M ≤ 1024), and elements below
``G * 2**-(K+1)`` become 0. The float32 mean of a float all-reduce has a relative error around
``2**-24`` of each partial sum, far coarser: exact mode is as accurate as float, deterministic besides.
(M up to 2**20 still leaves K ≥ 42.)

Cost: one extra scalar all-reduce per step and an int64 all-reduce (8 bytes per element instead of
4), plus the quantize / dequantize passes.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from hp.core.errors import HpError

HEADROOM_BITS = 1  # |sum| <= 2**(63 - HEADROOM_BITS)


class NonFiniteGradientError(HpError):
    """A micro-batch gradient holds NaN or inf: exact mode reports it rather than quantizing it."""


def precision_bits(total_micro_batches: int) -> int:
    """K: the bits of magnitude the step's max element gets (``|q| <= 2**K``), ``62 - ceil(log2 M)``."""
    if total_micro_batches <= 0:
        raise ValueError(f"total_micro_batches must be positive, got {total_micro_batches}")
    return 63 - HEADROOM_BITS - (total_micro_batches - 1).bit_length()


def scale_shift(global_max: float, total_micro_batches: int) -> int:
    """The shared exponent: quantize with ``g * 2**shift``; the same for every rank and every W."""
    if not math.isfinite(global_max) or global_max < 0:
        raise ValueError(f"global max must be finite and non-negative, got {global_max}")
    if global_max == 0.0:
        return 0
    _, e = math.frexp(global_max)  # global_max = f * 2**e, 0.5 <= f < 1, so global_max < 2**e
    return precision_bits(total_micro_batches) - e


def _times_pow2(x: torch.Tensor, shift: int) -> torch.Tensor:
    """``x * 2**shift`` in float64, exact barring over/underflow (two factors: each stays in range)."""
    half = shift // 2
    return x * math.ldexp(1.0, half) * math.ldexp(1.0, shift - half)


def quantize(grad: torch.Tensor, shift: int) -> torch.Tensor:
    """``round_half_even(grad * 2**shift)`` as int64 (the caller guarantees the result fits)."""
    return torch.round(_times_pow2(grad.detach().to(torch.float64), shift)).to(torch.int64)


def dequantize(total: torch.Tensor, shift: int, total_micro_batches: int, dtype: torch.dtype) -> torch.Tensor:
    """The mean from the integer sum: ``float64(total) * 2**-shift / M`` in ``dtype``."""
    return (_times_pow2(total.to(torch.float64), -shift) / total_micro_batches).to(dtype)


def _stats(micro_grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[max finite |g|, any NaN, any inf] over this rank's micro-batch gradients, float64."""
    out = torch.zeros(3, dtype=torch.float64, device=device)
    for g in micro_grads:
        a = g.detach().abs().to(torch.float64)
        out[0] = torch.maximum(out[0], torch.where(torch.isfinite(a), a, 0.0).amax())
        out[1] = torch.maximum(out[1], torch.isnan(a).any().to(torch.float64))
        out[2] = torch.maximum(out[2], torch.isinf(a).any().to(torch.float64))
    return out


def _distributed(group: object) -> bool:
    if dist.is_available() and dist.is_initialized():
        return True
    if group is not None:
        raise ValueError("a process group was given but torch.distributed is not initialized")
    return False


def exact_mean(micro_grads: Sequence[torch.Tensor], total_micro_batches: int, group: object = None, *,
               numel: int | None = None, device: torch.device | str | None = None,
               micro_ids: Sequence[int] | None = None) -> torch.Tensor:
    """The mean over all ``total_micro_batches`` of the step's micro-batch gradients, bit-identical at any W.

    ``micro_grads``: this rank's micro-batch gradients (flat tensors of one shape and floating dtype;
    may be empty when the rank owns no micro-batch, then give ``numel`` and, off CPU, ``device``). Collective over ``group``
    (the default group when None; no collective when torch.distributed is not initialized, i.e. W=1).
    ``micro_ids`` only labels the error message. Raises :class:`NonFiniteGradientError` on every rank
    when any rank's gradient holds NaN or inf.
    """
    grads = [g.reshape(-1) for g in micro_grads]
    if grads:
        n, dtype, dev = grads[0].numel(), grads[0].dtype, grads[0].device
        if any(g.numel() != n or g.dtype != dtype for g in grads):
            raise ValueError("micro-batch gradients must all have the same numel and dtype")
        if not dtype.is_floating_point:
            raise ValueError(f"gradients must be floating point, got {dtype}")
        if numel is not None and numel != n:
            raise ValueError(f"numel={numel} but the gradients have {n} elements")
    elif numel is None:
        raise ValueError("a rank with no micro-batch must give numel")
    else:
        n, dtype, dev = numel, torch.float32, torch.device(device or "cpu")
    if len(grads) > total_micro_batches:
        raise ValueError(f"{len(grads)} micro-batch gradients on this rank but only {total_micro_batches} in the step")
    collective = _distributed(group)
    stats = _stats(grads, dev)
    local_bad = stats[1].item() > 0 or stats[2].item() > 0
    if collective:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    if stats[1].item() > 0 or stats[2].item() > 0:
        kinds = " and ".join(k for k, v in (("NaN", stats[1].item()), ("inf", stats[2].item())) if v > 0)
        if local_bad:
            ids = micro_ids if micro_ids is not None else range(len(grads))
            bad = [m for m, g in zip(ids, grads) if not torch.isfinite(g).all()]
            where = f"in micro-batch(es) {bad} on this rank"
        else:
            where = "on another rank"
        raise NonFiniteGradientError(f"exact mode: gradient holds {kinds} {where}; step not reduced")
    shift = scale_shift(stats[0].item(), total_micro_batches)
    acc = torch.zeros(n, dtype=torch.int64, device=dev)
    for g in grads:
        acc += quantize(g, shift)
    if collective:
        dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=group)
    return dequantize(acc, shift, total_micro_batches, dtype)
