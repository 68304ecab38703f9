"""The step transaction: gradient reduction → (the user's clipping) → commit vote → local update.

``reduce`` averages the gradients across ranks (:mod:`hp.checkpointless.reduction`: by default ONE
float all-reduce) over a flat buffer, and the parameters' ``.grad`` are views into that buffer (as DDP's ``gradient_as_bucket_view``): backward
accumulates straight into it, clipping and AMP unscaling act on it in place, and the sharded
optimizer's roll-forward finds there exactly the gradients the update used. With
``broadcast_buffers`` (the default, as in DDP) rank 0's buffers (BatchNorm running statistics) go to
every rank in the same phase. With a registered ``torch.amp.GradScaler`` the averaged gradients are
unscaled, and whether they hold an inf/NaN travels in the vote, so every rank skips the same steps.

With a model sharded by FSDP2 (:mod:`hp.checkpointless.fsdp`) FSDP reduces the gradients itself,
inside backward; ``reduce`` then only marks them reduced (over micro-batches, FSDP reduced each one's
backward and accumulated: scaled to the mean over the step's micro-batches), unscales them with a
scaler (the verdict travels in the vote as for replicated state; a skipped step is skipped by the
buddies' shadows too), sends this rank's gradients of
its shard to its buddy (pure FSDP: :mod:`hp.checkpointless.shadow`) and broadcasts the buffers: the vote
still decides.

A step may be split in ``M`` micro-batches (:meth:`StepTransaction.split`): the mean is then over the M
micro-batches, whichever ranks computed them, and the vote carries one loss per micro-batch, summed in
micro-batch order, so the step's loss does not depend on the world size either.

``vote`` is the commit point: one small all-reduce that every rank must enter. It also carries whether
any rank has seen a planned generation (a grow, a graceful preemption), so that all ranks re-form
after the same step. Everything a failure
before it did is rolled back by :meth:`hp.checkpointless.registry.TrainingState.rollback` (and
:meth:`StepTransaction.abort`); ``apply`` after it is local and cannot be stopped by a peer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hp.checkpointless import state
from hp.checkpointless.recovery import CollectiveError
from hp.checkpointless.reduction import Collective, MeanReduction, Reduction
from hp.checkpointless.registry import TrainingState

VOTE_HEAD = 4  # [ranks voting, ranks that saw inf/NaN, that saw a planned generation, that saw the job end], then the losses


class StepTransaction:
    def __init__(self, training: TrainingState, collective: Collective, reduction: Reduction | None = None) -> None:
        self._st, self._collective = training, collective
        self.reduction: Reduction = reduction if reduction is not None else MeanReduction()
        self.micro_batches: int | None = None  # M when the current step is split in micro-batches
        self.grads: torch.Tensor | None = None  # one flat buffer, allocated once (kept: see group.py)
        self.grads_step = -1  # the step whose averaged gradients `grads` holds
        self._views: list[torch.Tensor | None] = []  # per parameter: its slice of `grads` (None: other dtype)
        self._ranges: list[tuple[int, int]] = []  # per parameter: (offset, numel) in `grads`
        self._vote = torch.zeros(VOTE_HEAD + 1, dtype=torch.float64)  # reallocated when the loss slots change
        self._bcast: state.StateBuffer | None = None
        self._found_inf = False
        self._unscaled = False

    # ---- before the vote ----------------------------------------------------------------------
    def begin(self) -> None:
        """A step (or its replay) starts: its backward accumulates into zeroed gradients. Zeroed here,
        not after the previous update: until the next step begins, the averaged gradients of the last
        committed step are what a sharded optimizer's roll-forward needs (a peer that died in the tail)."""
        self.grads_step = -1
        self.micro_batches = None
        if self._st.fsdp is not None:
            self._st.fsdp.clear_grads()
        self.reduction.begin()
        if self.grads is not None:
            self.grads.zero_()
        for p, view in zip(self._st.params, self._views):
            if view is None and p.grad is not None:
                p.grad.zero_()

    def split(self, micro_batches: int) -> None:
        """This step is ``micro_batches`` micro-batches in all (over every rank): the mean is over them."""
        if self.micro_batches not in (None, micro_batches):
            raise ValueError(f"a step has one micro-batch count, got {micro_batches} after {self.micro_batches}")
        self.micro_batches = micro_batches

    def micro_batch_done(self, m: int) -> None:
        """Micro-batch ``m``'s backward is done on this rank (the reduction may set its gradients aside;
        FSDP has reduced them, into the sharded gradients it accumulates)."""
        if self._st.fsdp is not None:
            return
        self._gather(fold=True)
        self.reduction.micro_batch_done(self.grads, m)

    def gradient_ready(self, index: int) -> None:
        """Backward accumulated parameter ``index``'s gradient (its post-accumulate-grad hook): a
        reduction that overlaps backward (:mod:`hp.checkpointless.overlap`) may start on it now, when it
        already lies in the flat buffer and the step is not split in micro-batches (reduced at its end)."""
        ready = getattr(self.reduction, "gradient_ready", None)
        if ready is None or self.micro_batches is not None or self.grads is None:
            return
        view, grad = self._views[index], self._st.params[index].grad
        if view is not None and grad is not None and grad.data_ptr() == view.data_ptr():
            ready(self.grads, index, self._collective)

    def reduce(self, step: int, world_size: int) -> None:
        """Average gradients (and with a scaler unscale them), broadcast rank 0's buffers."""
        if self._st.fsdp is not None:
            if self.micro_batches is not None:  # each backward averaged over the ranks: the sum of k = M / W
                self._st.fsdp.scale_grads(world_size / self.micro_batches)  # such means, made the mean of M
            self.grads_step = step  # FSDP reduced them during backward
            self._unscale(lambda: self._st.fsdp.finite_grads())  # before the buddy gets them: what the update uses
            self._st.fsdp.send_gradients(dist.get_rank(), self._st.optimizer, step, self._collective)
            if self._st.broadcast_buffers and world_size > 1:
                self._broadcast_buffers()
            return
        grads = self._gather(fold=self.micro_batches is not None)
        self.grads_step = -1
        self.reduction.reduce(grads, self.micro_batches or world_size, self._collective)
        self.grads_step = step
        self._scatter_other_dtypes()
        if self._st.broadcast_buffers and world_size > 1:
            self._broadcast_buffers()
        self._unscale(lambda: bool(torch.isfinite(grads).all()))

    def _unscale(self, finite: Callable[[], bool]) -> None:
        """With an enabled scaler: unscale the reduced gradients in place (decides nothing yet: the vote
        does, from every rank's ``not finite()``). On an FSDP model's DTensor gradients torch's unscale also
        max-reduces the inf/NaN flag over the shard dimensions, so the scaler's own verdict (its
        ``update()``) is the same on every rank too."""
        scaler = self._st.scaler
        if scaler is not None and scaler.is_enabled():
            scaler.unscale_(self._st.optimizer)
            self._unscaled = True
            self._found_inf = not finite()

    def vote(self, step: int, losses: dict[int, float], world_size: int, boundary: bool,
             finishing: bool = False) -> tuple[float, bool, bool, bool]:
        """Every rank's yes. ``losses``: this rank's loss per slot (its micro-batches' ids, or its rank when
        the step is not split), ``boundary``: this rank has seen a planned generation, ``finishing``: a plan
        that ends the job. Returns (global mean loss, skip: some gradient was inf/NaN, re-form after this
        step, the job ends after this step): the same on every rank."""
        slots = self.micro_batches or world_size
        if self._vote.numel() != VOTE_HEAD + slots:
            self._vote = torch.zeros(VOTE_HEAD + slots, dtype=torch.float64)  # kept referenced: see group.py
        vote = self._vote
        vote.zero_()
        vote[0], vote[1], vote[2], vote[3] = 1.0, float(self._found_inf), float(boundary), float(finishing)
        for slot, loss in losses.items():
            vote[VOTE_HEAD + slot] = loss
        self._collective(dist.all_reduce, vote)
        if int(vote[0]) != world_size:
            raise CollectiveError(f"commit vote of step {step}: {int(vote[0])}/{world_size}")
        # each slot has one writer, so the sum holds its loss exactly; adding the slots in their order
        # makes the mean the same bits whoever computed them. Every rank checked the same averaged
        # gradients, so every rank found the same inf/NaN; the sum makes it one decision all the same
        total = 0.0
        for loss in vote[VOTE_HEAD:].tolist():
            total += loss
        return total / slots, int(vote[1]) > 0, int(vote[2]) > 0, int(vote[3]) > 0

    # ---- after the vote (local) -------------------------------------------------------------
    def apply(self, step: int, skip: bool) -> None:
        """The committed step's local update; ``skip``: the scaler's inf/NaN verdict, taken by every rank."""
        st = self._st
        if st.fsdp is not None and skip:  # a buddy's shadow skips its ward's update of this step too
            st.fsdp.skipped = step
        if st.scaler is not None and self._unscaled:
            if not skip:
                self._optimizer_step(step, lambda: st.scaler.step(st.optimizer))
            st.scaler.update()  # backs the scale off after a skipped step, grows it after enough good ones
        elif not skip:
            self._optimizer_step(step, st.optimizer.step if st.optimizer is not None else None)
        self._unscaled = self._found_inf = False
        if st.scheduler is not None:
            st.scheduler.step()

    def _optimizer_step(self, step: int, plain: Callable[[], Any] | None) -> None:
        if self._st.sharded is not None:
            self._st.sharded.local_step(step)
        elif plain is not None:
            plain()

    def abort(self) -> None:
        """A failure: forget the step's unscale (its gradients are zeroed when the replay begins)."""
        if self._unscaled:  # update(new_scale=same) is torch's public way to reset a scaler's per-step state
            self._st.scaler.update(new_scale=self._st.scaler.get_scale())
        self._unscaled = self._found_inf = False

    # ---- the flat gradient buffer -----------------------------------------------------------
    def _gather(self, fold: bool = False) -> torch.Tensor:
        """The flat buffer with every gradient in it. ``fold``: a step split in micro-batches adds the
        gradients that are not views (another dtype) into the buffer and zeroes them, so the buffer
        holds the sum so far whatever the reduction did with it after the previous micro-batch."""
        params = self._st.params
        if self.grads is None:
            # on the parameters' device: their .grad are views into it (the vote and buffers stay on the host)
            self.grads = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            offset = 0
            for p in params:
                view = self.grads[offset:offset + p.numel()].view_as(p)
                self._views.append(view if p.dtype == self.grads.dtype and p.is_contiguous() else None)
                self._ranges.append((offset, p.numel()))
                offset += p.numel()
            if hasattr(self.reduction, "plan"):
                self.reduction.plan(self._ranges, self.grads.element_size())
        offset = 0
        for p, view in zip(params, self._views):
            n = p.numel()
            if view is None and fold:
                if p.grad is not None:
                    self.grads[offset:offset + n].add_(p.grad.reshape(-1))
                    p.grad.zero_()
            elif view is None:
                target = self.grads[offset:offset + n]
                target.copy_(p.grad.reshape(-1)) if p.grad is not None else target.zero_()
            elif p.grad is None:
                view.zero_()
                p.grad = view
            elif p.grad.data_ptr() != view.data_ptr():  # a new tensor (e.g. after zero_grad(set_to_none=True))
                view.copy_(p.grad)
                p.grad = view
            offset += n
        return self.grads

    def _scatter_other_dtypes(self) -> None:
        offset = 0
        for p, view in zip(self._st.params, self._views):
            if view is None:
                flat = self.grads[offset:offset + p.numel()].view(p.shape)
                if p.grad is None:
                    p.grad = flat.to(p.dtype)
                else:
                    p.grad.copy_(flat)
            offset += p.numel()

    def load_grads(self) -> None:
        """Put the averaged gradients of ``grads_step`` back into ``.grad`` (a sharded roll-forward)."""
        for p, view in zip(self._st.params, self._views):
            if view is not None:
                p.grad = view
        self._scatter_other_dtypes()

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers to every rank: packed into one flat uint8 buffer (any dtype), one broadcast."""
        buffers = self._st.buffers
        if not buffers:
            return
        if self._bcast is None:
            self._bcast = state.StateBuffer(state.flatten(buffers)[0])
        flat = self._bcast.pack(buffers)
        self._collective(dist.broadcast, flat, 0)
        if dist.get_rank() != 0:
            with torch.no_grad():
                for buf, got in zip(buffers, self._bcast.unpack()):
                    buf.copy_(got)
