"""Test worker under ``hp run --service ckpt``: the daemon and its peers come from the environment.

Attempt 0 saves ``--steps`` and, with ``--crash``, SIGKILLs itself right after; attempt 1 (or a run
without ``--crash``) loads the newest checkpoint and writes a JSON result to ``--out.<rank>``:
which step and tier it got, whether the values match, the ckpt environment, and what the peer
daemons hold of this namespace.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch.distributed as dist

from ckpt_worker import same, state
from hp.tiered_ckpt import TieredConfig, api
from hp.tiered_ckpt.client import DaemonClient


def replicated(peer: DaemonClient, step: int, timeout_s: float = 60) -> bool:
    """Whether ``peer`` holds a complete copy of ``step`` (replication runs behind the save)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(s["step"] == step and s["complete"] for s in peer.steps("job")):
            return True
        time.sleep(0.1)
    return False


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", default="1,2")
    p.add_argument("--crash", action="store_true")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world > 1:
        dist.init_process_group("gloo")
    cfg = TieredConfig.from_env("job")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0:
        for s in [int(x) for x in a.steps.split(",")]:
            api.save(state(s, world, fill=True), s, cfg)
        if a.crash:
            os.kill(os.getpid(), signal.SIGKILL)
    if world > 1:
        dist.barrier()  # every rank's save is sealed before anyone looks at the replicas
    sd = state(0, world, fill=False)
    reader = api.load(sd, cfg)
    peers = {name: replicated(DaemonClient(addr, cfg.token), reader.step)
             for name, addr in zip(cfg.peers, cfg.peer_addrs())}
    out = {"rank": rank, "attempt": attempt, "step": reader.step, "tier": reader.ref.tier,
           "ok": same(sd, state(reader.step, world, fill=True)), "daemon": cfg.daemon, "peers": cfg.peers,
           "peers_hold_step": peers, "pid": os.getpid()}
    with open(f"{a.out}.{rank}", "w") as f:
        json.dump(out, f)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # leave without interpreter teardown: gloo's threads can abort the process in their destructors
    # ("terminate called without an active exception": SIGABRT after a successful run, seen in CI)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
