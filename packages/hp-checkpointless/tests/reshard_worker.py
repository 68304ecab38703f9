"""One process of test_reshard.py: `reshard_worker.py SCENARIO ROLE PORT OUTDIR` (ROLE: a rank of the first
generation, or ``joiner``: a fresh process that joins the second one).

The harness drives what the runtime would, with a gloo group per generation that it forms itself on the
test's TCPStore: a ``TrainingState`` with a ZeroRedundancyOptimizer factory (AdamW) and an LR scheduler,
a ``StepTransaction``, the runtime's step tail (reduce → local shard update → scheduler → committed →
parameter sync → replication), and at a re-form what ``Formation._form`` does: rebind, agree (the
contract's ``previous_world``/``previous_ranks`` included), hydrate. Faults are scripted: a rank that dies
SIGKILLs itself at a chosen point, and the survivors then skip what would have failed (the vote or the
tail's collectives), which leaves exactly the state a real failure there leaves; a rank that dies while
resharding (``dies_resharding``) does so at its first state transfer, and the survivors see that
transfer fail for real, release the group and re-form once more.

Every rank's gradient of step s is the same tensor, with 10 significant bits: summing W copies and
dividing by W gives it back exactly for any W <= 4, so a single-process AdamW fed the same gradients is
a bit-exact reference at every world size (:func:`reference`).

Writes OUTDIR/{old,after,final}-{ROLE}.pt (the held shard's states by parameter name, and every parameter)
and OUTDIR/{ROLE}.json (what it observed); events go to OUTDIR/events.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from hp.checkpointless import hydration, sharded, transfer
from hp.checkpointless.agreement import Agreement
from hp.checkpointless.events import EventLog
from hp.checkpointless.registry import TrainingState
from hp.checkpointless.transaction import StepTransaction

LR, WEIGHT_DECAY, GAMMA = 1e-2, 0.1, 0.8
FAULT_STEP, STEPS = 3, 7  # the fault happens in step 3; training goes on to step 6 at the new world size


@dataclass(frozen=True)
class Scenario:
    world: int  # of the first generation
    dies: tuple[int, ...]  # ranks that die in FAULT_STEP...
    when: str  # ...in its forward ("before_vote": nobody commits it, it is replayed at the new size), or
    # "after_commit": after its local update, before its parameter sync and replication
    missed: tuple[int, ...] = ()  # ranks that miss FAULT_STEP's vote (the others pass it)
    joiners: int = 0  # fresh processes that join the second generation
    dies_resharding: tuple[int, ...] = ()  # ranks that die at their first transfer of the second generation
    bucket_view: bool = False  # ZeroRedundancyOptimizer(parameters_as_bucket_view=...)
    nodes: tuple[int, ...] = ()  # the node of each rank of the first generation (joiners: node 0); (): all on 0


SCENARIOS = {
    "shrink": Scenario(4, (2,), "before_vote"),
    "shrink_rolled": Scenario(4, (2,), "after_commit", missed=(1,), bucket_view=True),
    "grow": Scenario(3, (), "after_commit", joiners=1),
    "to_one": Scenario(2, (0,), "after_commit"),
    "replaced": Scenario(4, (1,), "after_commit", joiners=1),
    "lost": Scenario(4, (1, 2), "before_vote"),
    "shrink_again": Scenario(4, (1,), "before_vote", dies_resharding=(3,)),
    # 2 nodes of 2 ranks, node 1 lost: with buddies across nodes, ranks 0 and 1 hold its shards' copies
    "node_lost": Scenario(4, (2, 3), "before_vote", nodes=(0, 0, 1, 1)),
    "node_lost_rolled": Scenario(4, (2, 3), "after_commit", missed=(1,), nodes=(0, 0, 1, 1)),
}


def build_model() -> nn.Module:
    """Ten parameters of distinct sizes: torch partitions them differently for every world size, so
    that resharding moves state between ranks in both directions."""
    torch.manual_seed(0)
    widths = [8, 7, 21, 5, 11, 4]
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def gradients(step: int, model: nn.Module) -> list[torch.Tensor]:
    """Step ``step``'s gradient of every parameter: k/1024 with |k| <= 512 (exact in float32 sums)."""
    out = []
    for i, p in enumerate(model.parameters()):
        g = torch.Generator().manual_seed(1000 * step + i)
        out.append(torch.randint(-512, 513, p.shape, generator=g).to(p.dtype) / 1024)
    return out


def reference(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Plain AdamW over the whole model, fed the same gradients: what the sharded job must equal."""
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)
    for s in range(steps):
        for p, g in zip(model.parameters(), gradients(s, model)):
            p.grad = g
        opt.step()
        sched.step()
    return model, opt


def collective(fn, *args, **kwargs) -> None:
    fn(*args, **kwargs)


class Rank:
    def __init__(self, sc: Scenario, role: str, port: int, out: Path) -> None:
        self.role, self.out = role, out
        self.node = sc.nodes[int(role)] if sc.nodes and role.isdigit() else 0
        self.store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        self.model = build_model()
        self.names = {id(p): n for n, p in self.model.named_parameters()}
        self.st = TrainingState(self.model, optimizer=lambda params: ZeroRedundancyOptimizer(
            params, optimizer_class=torch.optim.AdamW, parameters_as_bucket_view=sc.bucket_view,
            lr=LR, weight_decay=WEIGHT_DECAY),
            scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA))
        self.tx = StepTransaction(self.st, collective)
        self.events = EventLog(str(out / "events"), f"rank-{role}")
        self.rank = self.world = -1
        self.result: dict = {}

    @property
    def sh(self) -> sharded.ShardedOptimizer:
        return self.st.sharded

    def form(self, generation: int, rank: int, world: int) -> None:
        """What Formation._form does: group, optimizer, rebind, agreement, hydration."""
        self.rank, self.world = rank, world
        dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{generation}", self.store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        if self.st.factories is not None:
            self.st.build_optimizer()
        self.sh.rebind(rank, world)
        before = self.sh.partition if self.sh.version >= 0 else (-1, -1)
        held_ring = self.sh.held_ring if self.sh.version >= 0 else ()
        info = torch.zeros(8, world, dtype=torch.int64)
        info[:, rank] = torch.tensor([self.st.committed, self.sh.version, self.sh.replica_version,
                                      self.tx.grads_step, *before, self.node,
                                      int(held_ring != sharded.identity(len(held_ring)))])
        dist.all_reduce(info)
        newest = int(info[0].max())
        worlds = set(info[5].tolist()) - {-1}
        assert len(worlds) <= 1, f"ranks hold shards of different partitionings: {worlds}"
        previous_world, ring = worlds.pop() if worlds else -1, ()
        if previous_world >= 0 and bool(info[7].any()):  # the held ring, from its lowest holder
            held = torch.zeros(previous_world, dtype=torch.int64)
            if rank == int((info[4] >= 0).nonzero()[0]):
                held.copy_(torch.tensor(held_ring))
            dist.all_reduce(held)
            ring = tuple(held.tolist())
        agreement = Agreement(
            generation, newest, source=int((info[0] == newest).nonzero()[0]),
            behind=[r for r in range(world) if info[0, r] < newest], versions=sharded.Versions(*info[:4].tolist()),
            previous_world=previous_world, previous_ranks=tuple(info[4].tolist()), ring=ring)
        same = previous_world == world and not agreement.resharding(world)
        self.sh.set_ring(ring if same else sharded.node_ring(info[6].tolist()))
        self.result.setdefault("rings", []).append({"held": list(ring), "new": list(self.sh.ring)})
        self.result["agreement"] = {"generation": generation, "newest": newest,
                                    "previous_world": agreement.previous_world,
                                    "previous_ranks": list(agreement.previous_ranks)}
        hydration.sharded_optimizer(self.st, self.tx, agreement, rank, collective, self.events)

    def leave_group(self) -> None:
        self.sh.unbind()
        dist.destroy_process_group()

    def begin_step(self, step: int) -> None:
        self.tx.begin()
        for p, g in zip(self.st.params, gradients(step, self.model)):
            p.grad = g
        self.tx.reduce(step, self.world)
        # the vote is left out: its outcome is scripted (every rank passes it unless told otherwise)

    def commit(self, step: int) -> None:
        self.tx.apply(step, False)
        self.st.mark_committed(step)

    def share(self) -> None:
        collective(self.sh.sync_params)
        self.sh.replicate(self.rank, collective)

    def dump(self, name: str) -> None:
        _, states = self.sh.held_shard()
        held_rank, held_world = self.sh.partition
        params = self.sh.partitioning(held_world)[held_rank]
        # clones: torch.save of a view writes its whole storage (here: a receive buffer of raw bytes)
        torch.save({"state": {self.names[id(p)]: {k: v.clone() if isinstance(v, torch.Tensor) else v
                                                  for k, v in s.items()} for p, s in zip(params, states)},
                    "params": {n: p.detach().clone() for n, p in self.model.named_parameters()}},
                   self.out / f"{name}-{self.role}.pt")
        self.result[name] = {"version": self.sh.version, "partition": [held_rank, held_world],
                             "committed": self.st.committed, "lr": [g["lr"] for g in self.sh.zero.param_groups],
                             "local_lr": [g["lr"] for g in self.sh.zero.optim.param_groups]}

    def save(self) -> None:
        (self.out / f"{self.role}.json").write_text(json.dumps(self.result))


def die_at_first_transfer() -> None:
    def die(*args, **kwargs) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    transfer.send_state = transfer.recv_state = die


def main(scenario: str, role: str, port: int, out: Path) -> None:
    sc = SCENARIOS[scenario]
    alive = [r for r in range(sc.world) if r not in sc.dies]
    me = Rank(sc, role, port, out)
    if role == "joiner":
        me.form(2, len(alive), len(alive) + sc.joiners)
    else:
        rank = int(role)
        me.form(1, rank, sc.world)
        for step in range(FAULT_STEP):
            me.begin_step(step)
            me.commit(step)
            me.share()
        if sc.when == "after_commit":
            me.begin_step(FAULT_STEP)
            if rank not in sc.missed:
                me.commit(FAULT_STEP)
        me.dump("old")
        me.save()
        if rank in sc.dies:
            os.kill(os.getpid(), signal.SIGKILL)
        if not sc.dies and sc.when == "after_commit":
            me.share()  # a planned grow: the step finished everywhere
        generation, failed = 2, None
        while True:
            me.leave_group()
            if rank in sc.dies_resharding:
                die_at_first_transfer()
            try:
                me.form(generation, alive.index(rank), len(alive) + sc.joiners)
            except sharded.ShardLost as e:
                me.result["lost"] = str(e)
                me.save()
                me.leave_group()  # as the runtime's close(): exiting with a live gloo group can abort in teardown
                return
            except RuntimeError as e:  # a peer died while resharding (gloo, or a state transfer)
                failed = f"generation {generation}: {e}"[:300]
            if failed is None:
                break
            # out of the except block: its frames no longer hold the failed group (DESIGN.md lessons)
            me.result.setdefault("failed", []).append(failed)
            generation, failed = generation + 1, None
            alive = [r for r in alive if r not in sc.dies_resharding]
    me.dump("after")
    for step in range(me.st.committed + 1, STEPS):
        me.begin_step(step)
        me.commit(step)
        me.share()
    me.dump("final")
    me.save()
    me.leave_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
