"""Resharding the ZeRO-1 optimizer when the world size changes: real gloo groups of reshard_worker.py
processes (CPU), one job per scenario, compared bit for bit with a single-process AdamW fed the same
gradients (reshard_worker.reference: every rank's gradient is the same exactly representable tensor,
so the averaged gradient is that tensor at any world size).

For each job: after the reshard every rank holds the same parameters, the new shards together hold
exactly the per-parameter optimizer states the old shards held at the committed step (and the
reference's), the hyper-parameters agree, and after more steps at the new world size parameters and
states still equal the reference's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from hp.checkpointless.events import read_events
from hp.checkpointless.sharded import ShardedOptimizer
from hp.core.warm_start import python_command

WORKER_PATH = Path(__file__).with_name("reshard_worker.py")
_spec = importlib.util.spec_from_file_location("reshard_worker", WORKER_PATH)
worker = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))  # dataclasses look it up
_spec.loader.exec_module(worker)
TIMEOUT_S = 180  # a hang bound only: a job takes ~10 s (5 processes importing torch on 2 cores)


def test_rebind_keeps_the_held_shard_until_resharded_and_returns_to_it() -> None:
    """In process, on a group of 1 (rebind only re-partitions; no group of the new size is used)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = worker.build_model()
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=worker.LR)
        sh = ShardedOptimizer(zero, list(model.parameters()))
        for p, g in zip(model.parameters(), worker.gradients(0, model)):
            p.grad = g
        sh.local_step(0)
        held = zero.optim
        sh.rebind(1, 3)
        assert (zero.rank, zero.world_size, sh.partition) == (1, 3, (0, 1))
        assert sh.previous is not None and sh.previous.optim is held and not zero.optim.state
        assert [p for g in zero.optim.param_groups for p in g["params"]] == sh.partitioning(3)[1]
        assert sorted(map(id, sum(sh.partitioning(3), []))) == sorted(map(id, model.parameters()))
        sh.rebind(2, 4)  # that re-form failed; the next one is at yet another size
        assert sh.partition == (0, 1) and sh.previous.optim is held
        sh.rebind(0, 1)  # back to the held partitioning before any reshard: its optimizer again
        assert zero.optim is held and sh.previous is None and len(held.state) == len(list(model.parameters()))
    finally:
        dist.destroy_process_group()


class Job:
    def __init__(self, scenario: str, out: Path) -> None:
        self.scenario, self.out = scenario, out
        sc = worker.SCENARIOS[scenario]
        self.world, self.dies = sc.world, sc.dies + sc.dies_resharding
        self.roles = [str(r) for r in range(self.world)] + ["joiner"] * sc.joiners
        self.survivors = [str(r) for r in range(self.world) if r not in self.dies] + ["joiner"] * sc.joiners
        self.codes: dict[str, int | None] = {}

    def run(self) -> Job:
        """Start every process; kill whatever is left at the end, a hang or a failed assertion included."""
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        procs: dict[str, subprocess.Popen] = {}
        try:
            for role in self.roles:
                with open(self.out / f"log-{role}.txt", "w") as log:
                    procs[role] = subprocess.Popen(
                        python_command([str(WORKER_PATH), self.scenario, role, str(store.port), str(self.out)]),
                        env=env, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + TIMEOUT_S
            for p in procs.values():
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for p in procs.values():
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait()
        self.codes = {role: p.returncode for role, p in procs.items()}
        expected = {role: -signal.SIGKILL if role.isdigit() and int(role) in self.dies else 0 for role in self.roles}
        assert self.codes == expected, f"{self.scenario}: exit codes {self.codes}\n{self.logs()}"
        return self

    def logs(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(self.out.glob("log-*.txt")))

    def result(self, role: str) -> dict:
        return json.loads((self.out / f"{role}.json").read_text())

    def dump(self, name: str, role: str) -> dict:
        return torch.load(self.out / f"{name}-{role}.pt", weights_only=True)

    def union(self, name: str, roles: list[str], version: int | None = None) -> dict[str, dict]:
        """The optimizer states of the shards ``roles`` held (at ``version`` only, if given), by parameter."""
        out: dict[str, dict] = {}
        for role in roles:
            if version is None or self.result(role)[name]["version"] == version:
                shard = self.dump(name, role)["state"]
                assert not set(shard) & set(out), f"{name}: parameters {set(shard) & set(out)} in two shards"
                out.update(shard)
        return out


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    return a == b


def reference(steps: int) -> tuple[dict[str, torch.Tensor], dict[str, dict], float]:
    model, opt = worker.reference(steps)
    names = {id(p): n for n, p in model.named_parameters()}
    return ({n: p.detach() for n, p in model.named_parameters()},
            {names[id(p)]: s for p, s in opt.state.items()}, opt.param_groups[0]["lr"])


def assert_matches_reference(job: Job, name: str, steps: int, local_lr: float) -> None:
    """Every survivor's parameters, the union of their shards and their learning rates after ``steps``
    (``local_lr``: what the local optimizers over the shards hold)."""
    params, states, lr = reference(steps)
    for role in job.survivors:
        got = job.dump(name, role)["params"]
        assert same(got, params), f"{name}: rank {role}'s parameters differ from the reference's"
        assert job.result(role)[name]["lr"] == [lr], f"{name}: rank {role}'s learning rate"
        assert job.result(role)[name]["local_lr"] == [local_lr], f"{name}: rank {role}'s local optimizer's lr"
    union = job.union(name, job.survivors)
    assert set(union) == set(params), f"{name}: the shards hold {sorted(union)}"
    diff = [n for n in params if not same(union[n], states[n])]
    assert not diff, f"{name}: optimizer states of {diff} differ from the reference's"


def rebuilt(job: Job, generation: int = 2) -> list[tuple]:
    return sorted((e["rank"], e["partition"], e["buddy"], e["rolled_forward"])
                  for e in read_events(str(job.out / "events"))
                  if e["event"] == "shard_rebuilt" and e["generation"] == generation)


def check_reshard(job: Job, new_world: int) -> int:
    """The checks every resharding job passes; returns the committed step it resharded at."""
    newest = job.result(job.survivors[0])["agreement"]["newest"]
    for role in job.survivors:
        after = job.result(role)["after"]
        assert after["version"] == newest == after["committed"]
        assert after["partition"] == [job.survivors.index(role), new_world]
    # the new shards hold what the old shards held at the committed step, bit for bit
    old = job.union("old", [str(r) for r in range(job.world)], version=newest)
    new = job.union("after", job.survivors)
    assert old and all(same(new[n], s) for n, s in old.items())
    # a reshard leaves the local optimizers with the scheduler's current learning rate on every rank;
    # a step leaves them with the one it used
    assert_matches_reference(job, "after", newest + 1, local_lr=reference(newest + 1)[2])
    assert_matches_reference(job, "final", worker.STEPS, local_lr=reference(worker.STEPS - 1)[2])
    return newest


def test_shrink_4_to_3_with_the_lost_shard_from_its_buddy_s_replica(tmp_path: Path) -> None:
    """Rank 2 dies before the vote of step 3: its shard of step 2 comes from rank 3's replica."""
    job = Job("shrink", tmp_path).run()
    assert job.result("0")["agreement"] == {"generation": 2, "newest": 2, "previous_world": 4,
                                            "previous_ranks": [0, 1, 3]}
    assert check_reshard(job, 3) == 2
    assert rebuilt(job) == [(2, 2, 2, False)]  # new rank 2 (old 3) rebuilt old partition 2


def test_shrink_4_to_3_rolls_the_lost_shard_and_a_missed_vote_forward(tmp_path: Path) -> None:
    """Rank 2 dies after its update of step 3 and before replicating it: rank 3's replica is one step
    old and rank 3 re-runs step 3's update on it; rank 1 missed step 3's vote and re-runs its own.
    The parameters are views into ZeRO's per-rank buckets (parameters_as_bucket_view=True)."""
    job = Job("shrink_rolled", tmp_path).run()
    assert job.result("2")["old"]["version"] == 3  # the dead rank had committed step 3
    assert job.result("1")["old"]["version"] == 2
    assert check_reshard(job, 3) == 3
    assert rebuilt(job) == [(1, 1, None, True), (2, 2, 2, True)]


def test_grow_3_to_4_a_joiner_gets_its_partition_from_the_owners(tmp_path: Path) -> None:
    job = Job("grow", tmp_path).run()
    assert job.result("joiner")["agreement"] == {"generation": 2, "newest": 3, "previous_world": 3,
                                                 "previous_ranks": [0, 1, 2, -1]}
    assert job.result("joiner")["after"]["partition"] == [3, 4]
    assert check_reshard(job, 4) == 3
    assert rebuilt(job) == []  # nothing was lost: the owners' shards moved


def test_shrink_2_to_1_the_survivor_rebuilds_rank_0_s_shard_alone(tmp_path: Path) -> None:
    """Rank 0 dies after its update of step 3: old rank 1, now rank 0 of a world of 1 (no buddy, no
    replication), rolls its replica of rank 0's shard forward and keeps every partition."""
    job = Job("to_one", tmp_path).run()
    assert job.result("1")["agreement"] == {"generation": 2, "newest": 3, "previous_world": 2, "previous_ranks": [1]}
    assert check_reshard(job, 1) == 3
    assert rebuilt(job) == [(0, 0, 0, True)]


def test_a_rank_replaced_at_the_end_keeps_the_world_size_and_moves_every_shard(tmp_path: Path) -> None:
    """Rank 1 dies after its update of step 3 and a fresh process joins at the end: the same world of
    4, but old ranks 2 and 3 are now 1 and 2, so their shards move; old rank 2 rolls rank 1's forward."""
    job = Job("replaced", tmp_path).run()
    assert job.result("joiner")["agreement"] == {"generation": 2, "newest": 3, "previous_world": 4,
                                                 "previous_ranks": [0, 2, 3, -1]}
    assert check_reshard(job, 4) == 3
    assert rebuilt(job) == [(1, 1, 1, True)]


def test_a_reshard_that_fails_midway_reshards_again_from_the_same_old_shards(tmp_path: Path) -> None:
    """4 -> 3 after rank 1 died; old rank 3 dies at its first transfer of that reshard, so the survivors
    re-form at 2 from the shards and replicas of the world of 4 they still hold: old partition 1 from
    old rank 2's replica, old partition 3 from old rank 0's."""
    job = Job("shrink_again", tmp_path).run()
    assert all(job.result(role)["failed"][0].startswith("generation 2: ") for role in job.survivors)
    assert job.result("0")["agreement"] == {"generation": 3, "newest": 2, "previous_world": 4,
                                            "previous_ranks": [0, 2]}
    assert check_reshard(job, 2) == 2
    assert rebuilt(job, generation=3) == [(0, 3, 0, False), (1, 1, 1, False)]


def test_a_shard_lost_with_its_buddy_is_the_same_verdict_on_every_survivor(tmp_path: Path) -> None:
    job = Job("lost", tmp_path).run()
    verdicts = {job.result(role)["lost"] for role in job.survivors}
    assert verdicts == {"the optimizer shard of rank 1 at step 2 is lost: its buddy rank 2 holds nothing; "
                        "no peer can rebuild it (restart the job from a checkpoint)"}


def test_a_lost_node_s_shards_come_from_buddies_on_the_other_node(tmp_path: Path) -> None:
    """2 nodes of 2 ranks: the replication ring is (0, 2, 1, 3), so rank 2's shard is copied to rank 1
    and rank 3's to rank 0 (with buddies (r + 1) % 4, node 1's ranks 2 and 3 would be each other's
    only copy). Node 1 is lost before the vote of step 3: 0 and 1 reshard 4 -> 2 from those copies."""
    job = Job("node_lost", tmp_path).run()
    assert job.result("0")["agreement"] == {"generation": 2, "newest": 2, "previous_world": 4,
                                            "previous_ranks": [0, 1]}
    for role in job.survivors:  # generation 1 made the ring across nodes; generation 2 agreed on it
        assert job.result(role)["rings"] == [{"held": [], "new": [0, 2, 1, 3]},
                                             {"held": [0, 2, 1, 3], "new": [0, 1]}]
    assert check_reshard(job, 2) == 2
    assert rebuilt(job) == [(0, 3, 0, False), (1, 2, 1, False)]


def test_a_lost_node_s_shards_one_step_old_are_rolled_forward_by_their_buddies(tmp_path: Path) -> None:
    """The same, with node 1 lost after its update of step 3 and before replicating it (rank 1 missed
    step 3's vote): ranks 0 and 1 roll their copies of old partitions 3 and 2 forward, rank 1 its own."""
    job = Job("node_lost_rolled", tmp_path).run()
    assert job.result("2")["old"]["version"] == job.result("3")["old"]["version"] == 3
    assert check_reshard(job, 2) == 3
    assert rebuilt(job) == [(0, 3, 0, True), (1, 1, None, True), (1, 2, 1, True)]
