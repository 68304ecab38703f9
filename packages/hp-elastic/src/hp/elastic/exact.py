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
3. each micro-batch gradient is quantized ``q = round_half_even(g * 2**shift)`` (an exact scaling,
   then one rounding; in float32 for 32- and 16-bit gradients, see ``_Workspace``, bit for bit the
   float64 of :func:`quantize`) and summed into an int64 accumulator on its rank;
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

In the step transaction, exact mode is :class:`ExactReduction` (below); :func:`exact_mean` is the same
reduction as a function over a list of gradients and a process group. Cost, for P gradient elements
of s bytes (s = 4 for float32) and k micro-batches on the rank:

- memory: the k saved micro-batch gradients, ``k * P * s`` bytes (a float reduction keeps none:
  backward sums into the one buffer; a plain step saves none either), plus the int64 accumulator,
  ``8 * P`` bytes, plus ~2.5 MB of scratch (quantize / dequantize run in blocks of :data:`CHUNK` elements);
- communication: one all-reduce(MAX) of 3 float64 scalars (a latency, no bandwidth) and ONE int64
  all-reduce of P elements, ``8 * P`` bytes: twice the bytes of the float32 all-reduce it replaces;
- compute: per saved micro-batch a copy into its slot and the zeroing of the buffer (when backward
  ends), a min/max pass and a quantize pass (read s, add 8 bytes per element); once per step a
  dequantize pass. ``hp bench exact`` (:mod:`hp.chaos.bench.exact`) measures what this costs a step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from hp.core.errors import HpError, UsageError

HEADROOM_BITS = 1  # |sum| <= 2**(63 - HEADROOM_BITS)
CHUNK = 1 << 17  # elements per quantize / dequantize block: the scratch (~2.5 MB) stays in cache

# collective(fn, *args, **kwargs): run one torch.distributed call on the group (the transaction's, or
# exact_mean's group); the same shape as hp.checkpointless.reduction.Collective
Collective = Callable[..., None]


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


class _Workspace:
    """What a reduction reuses from one step to the next: the int64 accumulator and the stats handed to
    the collectives (kept referenced, see DESIGN.md), and the scratch of one block of :data:`CHUNK`."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self.stats = torch.zeros(3, dtype=torch.float64, device=device)  # [max |g|, any NaN, any inf]
        self.acc = torch.zeros(numel, dtype=torch.int64, device=device)
        block = max(1, min(CHUNK, numel))
        # g * 2**shift is exact in float32 for float32/bfloat16/float16 gradients: each power-of-two factor
        # (|shift| / 2 <= 105 for these) is a float32, |g * 2**shift| <= 2**62 cannot overflow, and where a
        # factor < 1 makes it subnormal the result is < 2**-126, rounded to 0 either way; every float32 of
        # magnitude >= 2**23 is an integer, so round() and the int64 conversion are the float64 path's, bit for bit
        self.scaled = torch.empty(block, dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                                  device=device)
        self.ints = torch.empty(block, dtype=torch.int64, device=device)
        self.mean = torch.empty(block, dtype=torch.float64, device=device)

    def fits(self, t: torch.Tensor) -> bool:
        return t.numel() == self.numel and t.dtype == self.dtype and t.device == self.device


def _local_stats(grads: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """``out`` = [max finite |g|, any NaN, any inf] over this rank's gradients: one min/max pass each,
    and a second look only when that max is not finite (the step then fails anyway)."""
    out.zero_()
    for g in grads:
        if g.numel():
            lo, hi = torch.aminmax(g)  # NaN propagates, so a finite max means no NaN and no inf
            out[0] = torch.maximum(out[0], torch.maximum(-lo, hi).to(torch.float64))
    if not math.isfinite(out[0].item()):
        out.zero_()
        for g in grads:
            out[1] = torch.maximum(out[1], torch.isnan(g).any().to(torch.float64))
            out[2] = torch.maximum(out[2], torch.isinf(g).any().to(torch.float64))


def _non_finite(stats: torch.Tensor, local_bad: bool, grads: Sequence[torch.Tensor],
                ids: Sequence[int] | None) -> NonFiniteGradientError:
    kinds = " and ".join(k for k, v in (("NaN", stats[1].item()), ("inf", stats[2].item())) if v > 0)
    if not local_bad:
        where = "on another rank"
    elif ids is None:
        where = "in this rank's gradient"
    else:
        where = f"in micro-batch(es) {[m for m, g in zip(ids, grads) if not torch.isfinite(g).all()]} on this rank"
    return NonFiniteGradientError(f"exact mode: gradient holds {kinds} {where}; step not reduced")


def _reduce_into(out: torch.Tensor, grads: Sequence[torch.Tensor], total: int, collective: Collective | None,
                 ws: _Workspace, ids: Sequence[int] | None) -> None:
    """The exact mean over ``total`` micro-batches of which this rank holds ``grads`` (flat, ``ws``'s
    numel and dtype; may be empty) into ``out`` (flat, may be one of ``grads``: it is written last).
    ``collective`` None: this rank is the whole group."""
    stats, acc, n = ws.stats, ws.acc, ws.numel
    _local_stats(grads, stats)
    local_bad = stats[1].item() > 0 or stats[2].item() > 0
    if collective is not None:
        collective(dist.all_reduce, stats, op=dist.ReduceOp.MAX)
    if stats[1].item() > 0 or stats[2].item() > 0:
        raise _non_finite(stats, local_bad, grads, ids)
    shift = scale_shift(stats[0].item(), total)
    # g * 2**shift: one factor where 2**shift is a normal number of the scratch dtype, else two (as
    # _times_pow2); either is exact, or underflows only below 2**-126, where the rounding gives 0 anyway
    lo_exp, hi_exp = (-1022, 1023) if ws.scaled.dtype == torch.float64 else (-126, 127)
    up1, up2 = ((math.ldexp(1.0, shift), 1.0) if lo_exp <= shift <= hi_exp
                else (math.ldexp(1.0, shift // 2), math.ldexp(1.0, shift - shift // 2)))
    if not grads:
        acc.zero_()
    for start in range(0, n, CHUNK):
        end = min(n, start + CHUNK)
        scaled, ints, a = ws.scaled[:end - start], ws.ints[:end - start], acc[start:end]
        for j, g in enumerate(grads):  # q = round_half_even(g * 2**shift), summed in int64
            src = g[start:end]
            torch.mul(src, up1, out=scaled) if src.dtype == scaled.dtype else scaled.copy_(src).mul_(up1)
            (scaled.mul_(up2) if up2 != 1.0 else scaled).round_()
            if j == 0:
                a.copy_(scaled)
            else:
                ints.copy_(scaled)
                a.add_(ints)
    if collective is not None:
        collective(dist.all_reduce, acc, op=dist.ReduceOp.SUM)
    # as dequantize: float64(sum) * 2**-shift / M, then one cast. Where M * 2**shift is exact and no
    # quotient can leave the normal range, float64(sum) / (M * 2**shift) is the same bits in one pass
    # (one correctly rounded division of the same exact quotient)
    fused = total < 2**53 and -960 <= shift and shift + total.bit_length() <= 1020
    down1, down2 = math.ldexp(1.0, (-shift) // 2), math.ldexp(1.0, -shift - (-shift) // 2)
    for start in range(0, n, CHUNK):
        end = min(n, start + CHUNK)
        mean = ws.mean[:end - start].copy_(acc[start:end])
        mean.div_(math.ldexp(float(total), shift)) if fused else mean.mul_(down1).mul_(down2).div_(total)
        out[start:end].copy_(mean)


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
        if any(g.numel() != n or g.dtype != dtype or g.device != dev for g in grads):
            raise ValueError("micro-batch gradients must all have the same numel, dtype and device")
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
    collective = None
    if _distributed(group):
        def collective(fn, *args, **kwargs):
            fn(*args, group=group, **kwargs)
    out = torch.empty(n, dtype=dtype, device=dev)
    _reduce_into(out, grads, total_micro_batches, collective, _Workspace(n, dtype, dev),
                 micro_ids if micro_ids is not None else range(len(grads)))
    return out


class ExactReduction:
    """Exact mode for the step transaction: a :class:`hp.checkpointless.reduction.Reduction` whose mean
    gradient is bit-identical at any world size (the module's docstring says how and what it costs).

    ``micro_batch_done(grads, m)`` copies the flat gradient buffer (this rank's sum since the last zeroing,
    i.e. micro-batch ``m``'s gradient alone) into a slot and zeroes the buffer, so the next backward
    starts from zero. Slots are allocated the first time a rank holds that many micro-batches in a step
    and reused ever after (a rank that had k keeps ``k * P`` elements: shrinking raises k, growing leaves
    the spare slots allocated). ``reduce(grads, total, collective)`` runs the exact mean over the saved
    slots with two collectives (MAX of 3 scalars, SUM of P int64) and writes it into ``grads``; what
    ``grads`` holds then is ignored when micro-batches were saved.

    A step in which no ``micro_batch_done`` came takes the buffer itself as this rank's one contribution:
    on a rank that owns no micro-batch of a split step the buffer is zero (the step's ``begin`` zeroed
    it), so it adds nothing and the rank still takes part in both collectives, as it must. For a plain
    step (``total`` = the world size, one contribution per rank) the result is deterministic but exact
    only at a fixed W: each rank's contribution is then a sum over its own samples, which depends on W.

    A NaN or inf anywhere (seen by every rank after the first collective; the second is skipped
    everywhere) makes the mean NaN on every rank, as a float all-reduce would: with a registered
    ``GradScaler`` the transaction's inf/NaN verdict then skips the step and backs the scale off, as AMP
    expects (raising instead would fail the step, and its replay with the same scale and batch forever).
    """

    def __init__(self) -> None:
        self._slots: list[torch.Tensor] = []  # kept across steps; the first len(_ids) hold this step's
        self._ids: list[int] = []  # the micro-batches saved this step, in slot order
        self._ws: _Workspace | None = None

    def begin(self) -> None:
        self._ids.clear()

    def micro_batch_done(self, grads: torch.Tensor, m: int) -> None:
        if m in self._ids:
            raise UsageError(f"exact mode: micro-batch {m} reported twice in one step")
        k = len(self._ids)
        if self._slots and not (self._slots[0].numel() == grads.numel() and self._slots[0].dtype == grads.dtype
                                and self._slots[0].device == grads.device):
            if k:
                raise UsageError("exact mode: the gradient buffer changed within a step")
            self._slots.clear()  # a new buffer (another model): the old slots are of no use
        if k == len(self._slots):
            self._slots.append(torch.empty(grads.numel(), dtype=grads.dtype, device=grads.device))
        self._slots[k].copy_(grads.reshape(-1))
        grads.zero_()
        self._ids.append(m)

    def reduce(self, grads: torch.Tensor, total: int, collective: Collective) -> None:
        k = len(self._ids)
        if not grads.dtype.is_floating_point or not grads.is_contiguous():
            raise UsageError(f"exact mode needs a contiguous floating-point gradient buffer, got {grads.dtype}")
        if total < max(k, 1):
            raise UsageError(f"exact mode: {max(k, 1)} contributions on this rank but total={total}")
        flat = grads.view(-1)
        if self._ws is None or not self._ws.fits(flat):
            self._ws = _Workspace(flat.numel(), flat.dtype, flat.device)
        contributions = self._slots[:k] if k else [flat]
        try:
            _reduce_into(flat, contributions, total, collective, self._ws, self._ids if k else None)
        except NonFiniteGradientError:
            flat.fill_(float("nan"))
