"""torchft baseline: one replica group per process, torchft's DDP on gloo, healed from a live peer.

    torchft_lighthouse --min_replicas 3 --bind 127.0.0.1:PORT &
    TORCHFT_LIGHTHOUSE=http://127.0.0.1:PORT REPLICA_GROUP_ID=r torchrun --nproc-per-node 1 \\
        --max-restarts 1 --master-port P_r -m hp.chaos.baselines.torchft_ddp --replicas 4 --log-dir DIR

This is how torchft users run DDP (one ``torchrun --max-restarts`` per replica group, a Lighthouse
that forms a quorum of the live groups every step). Each process trains the model of ``hp demo``
(:func:`hp.checkpointless.demo.model.build_model`) on the same mmap-cached tokens, optimizer and
schedule as :mod:`hp.chaos.baselines.torchrun_dcp`, wrapped in ``torchft.DistributedDataParallel``
and driven by ``torchft.Manager``; replica ``r`` trains on the batch of (step, rank r, world 4) whether or not
its peers are alive, so a dead group's batches are simply not trained on (torchft's own sampler does
the same). In attempt 0 replica ``--fault-replica`` SIGKILLs itself right after committing
``--fault-step``. Survivors do not stop: their next quorum (once the Lighthouse stops counting the
dead group, ``heartbeat_timeout_ms``) has 3 groups and they go on at world 3. torchrun restarts the
dead group's process, which re-imports torch, joins a later quorum and receives the model, optimizer
and scheduler state from a live peer through torchft's checkpoint transport (HTTP by default).

Termination: a reference run stops after ``--steps``. A faulted run goes on past ``--steps`` until
a step is committed by every group again (for at most ``--rejoin-timeout`` seconds), so that the
rejoin is measured even when the restart outlasts the remaining steps; the bench compares only the
first ``--steps`` losses.

Dropout is reseeded from (seed, step, replica) at every step: a restarted group must draw the masks
that step would have had, whatever its RNG history (a peer's RNG state would repeat the peer's masks).

Events (JSON lines in ``<log-dir>/events``, as the torchrun baseline): ``started`` (process exec
time), ``imported``, ``data_attached``, ``model_ready`` (model and optimizer built), ``pg_ready`` (Manager
up and heartbeating; torchft forms the gloo group inside each quorum), ``restored`` (state received from a peer: healing),
``quorum`` (participant count changed), ``commit`` per committed step with the loss as float hex,
``participants`` and ``weights`` (a float64 sum of the updated parameters, as hex), ``step_failed`` (a step torchft discarded), ``fault_injected``.

torchft's transport unpickles the state it receives (``weights_only=False``): acceptable for a
baseline on loopback between our own processes, and one reason hp does not use it.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta
from typing import Any

from hp.chaos.baselines.torchrun_dcp import add_model_args, corpus_key, process_start_time
from hp.core.devices import pin_to_core
from hp.core.protocol import Event

MODULE = "hp.chaos.baselines.torchft_ddp"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=4, help="replica groups in the job (1 process each)")
    p.add_argument("--min-replicas", type=int, default=3, help="a step commits only with this many groups")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--fault-step", type=int, default=-1, help="--fault-replica dies after this step (-1: never)")
    p.add_argument("--fault-replica", type=int, default=1)
    p.add_argument("--log-dir", required=True, help="events/ and the start barrier go here")
    add_model_args(p)
    p.add_argument("--timeout", type=float, default=60.0, help="torchft's quorum/commit/transfer timeout, s")
    p.add_argument("--rejoin-timeout", type=float, default=120.0,
                   help="a faulted run trains past --steps for at most this long, waiting for the restarted group")
    return p.parse_args(argv)


def _start_barrier(directory: str, replica: int, replicas: int, timeout_s: float) -> None:
    """Wait until every group's Manager is heartbeating before the first quorum.

    Why: the Lighthouse issues a quorum as soon as every *heartbeating* group has joined, so a group
    that is still importing torch would be left out of step 0 and heal later: the fault-free run
    would then depend on start-up timing and could not serve as a reference."""
    os.makedirs(directory, exist_ok=True)
    open(os.path.join(directory, f"replica{replica}"), "w").close()
    deadline = time.monotonic() + timeout_s
    while len(os.listdir(directory)) < replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"start barrier: {len(os.listdir(directory))}/{replicas} groups after {timeout_s} s")
        time.sleep(0.05)


def weight_sum(model: Any) -> str:
    """float64 sum of every parameter after the update, as hex: a step's loss is computed before its
    update, so the loss of step F+1 cannot show that F+1 averaged 3 groups' gradients; this can.
    (Sums of equal weights are equal: the same ops in the same order on one thread.)"""
    import torch

    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters())).hex()


def main(argv: list[str] | None = None) -> None:
    started = process_start_time()
    args = parse_args(argv)
    replica = int(os.environ["REPLICA_GROUP_ID"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    from hp.checkpointless.events import EventLog

    events = EventLog(os.path.join(args.log_dir, "events"), f"replica{replica}-attempt{attempt}")

    def record(event: str, **fields: Any) -> None:
        events.record(event, rank=replica, attempt=attempt, **fields)

    record(Event.STARTED, at=started)
    pin_to_core(replica)  # HP_PIN_CORES=1 (hp bench recovery): one rank per core
    import torch
    import torch.nn.functional as F
    import torchft
    from hp.checkpointless.data import Batches, TokenCache, synthetic_corpus, tokenize
    from hp.checkpointless.demo.model import build_model

    record(Event.IMPORTED)
    cache = TokenCache.open(corpus_key(args.corpus_mb, args.vocab, args.seed),
                            lambda: tokenize(synthetic_corpus(args.corpus_mb << 20, args.seed), args.vocab))
    batches = Batches(cache, args.seq, args.batch_size, args.seed)
    record(Event.DATA_ATTACHED)

    torch.manual_seed(args.seed)  # every group builds identical weights: no step-0 sync needed
    model = build_model(args.model_size, args.vocab, args.seq, args.dropout)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(inner, T_max=args.steps)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict(), "sched": scheduler.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:  # torchft calls it on the main thread
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])
        scheduler.load_state_dict(state["sched"])
        record(Event.RESTORED, step=int(scheduler.last_epoch) - 1)

    record(Event.MODEL_READY)

    timeout = timedelta(seconds=args.timeout)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout), min_replica_size=args.min_replicas,
        load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"hp_bench_{replica}",
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout, init_sync=False)
    ddp = torchft.DistributedDataParallel(manager, model)
    record(Event.PG_READY)
    if attempt == 0:
        _start_barrier(os.path.join(args.log_dir, "ready"), replica, args.replicas, args.timeout)

    faulted = args.fault_step >= 0
    participants, past_steps = 0, None
    while True:
        step = manager.current_step()
        torch.manual_seed((args.seed << 32) + step * args.replicas + replica)
        x, y = batches.get(step, replica, args.replicas)
        # torchft.Optimizer's two calls, spelled out because the bench needs should_commit's answer
        manager.start_quorum()  # this step's quorum, asynchronously, overlapping the forward
        inner.zero_grad()
        loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        loss.backward()  # gradients averaged over the quorum's participants
        if not manager.should_commit():  # every group of the quorum must be able to commit
            record(Event.STEP_FAILED, step=step, error=str(manager.errored())[:300])
            continue
        inner.step()
        scheduler.step()
        done = manager.current_step() - 1  # a healing group jumps from 0 to its peers' step
        if manager.num_participants() != participants:
            participants = manager.num_participants()
            record(Event.QUORUM, step=done, participants=participants)
        record(Event.COMMIT, step=done, loss=loss.detach().item().hex(), participants=participants,
               weights=weight_sum(model))
        if attempt == 0 and replica == args.fault_replica and done == args.fault_step:
            record(Event.FAULT_INJECTED, kind="kill", step=done)
            os.kill(os.getpid(), signal.SIGKILL)
        if done + 1 >= args.steps:
            past_steps = past_steps or time.monotonic()
            if not faulted or participants == args.replicas or time.monotonic() - past_steps > args.rejoin_timeout:
                break
    # No teardown: like the torchrun baseline, a hung destructor would stall the launcher and be
    # charged to nobody; the Lighthouse forgets a group whose heartbeats stop.
    events.close()
    os._exit(0)


if __name__ == "__main__":
    main()
