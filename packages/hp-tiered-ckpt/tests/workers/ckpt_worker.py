"""Test worker: saves or loads a deterministic sharded state through hp.tiered_ckpt.

State of step S (any world size): a (12, 4) tensor ``w`` = arange * S, row-sharded (DTensor
``Shard(0)``) over the ranks, a replicated Linear(16, 8) + Adam state seeded by S, and a plain
Python object. ``load`` rebuilds zeros of the same structure for *its* world size, loads, and
compares against the expected values of the step it got. The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from hp.tiered_ckpt import NoCheckpointError, TieredConfig, api


def state(step: int, world: int, fill: bool) -> dict:
    torch.manual_seed(step if fill else 12345)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    w = torch.arange(48, dtype=torch.float32).reshape(12, 4) * step if fill else torch.zeros(12, 4)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        w = distribute_tensor(w, mesh, [Shard(0)])
    return {"model": model.state_dict(), "optim": opt.state_dict(), "w": w,
            "extra": {"step": step if fill else -1, "tag": f"s{step}" if fill else ""}}


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def same(a: dict, b: dict) -> bool:
    ok = all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    ok &= all(torch.equal(full(a["optim"]["state"][0][k]), full(b["optim"]["state"][0][k]))
              for k in ("exp_avg", "exp_avg_sq"))
    return ok and torch.equal(full(a["w"]), full(b["w"])) and a["extra"] == b["extra"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "load"])
    p.add_argument("--ns", required=True)
    p.add_argument("--daemon", required=True, help="HOST:PORT, or a comma-separated list: rank r uses entry r")
    p.add_argument("--peers", default="")
    p.add_argument("--url", default=None)
    p.add_argument("--steps", default="1", help="save: comma-separated steps")
    p.add_argument("--step", type=int, default=None, help="load: this step (default newest)")
    p.add_argument("--persist-every", type=int, default=1)
    p.add_argument("--ready-file", default=None, help="save: touch when done, then sleep (to be killed)")
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    daemons = a.daemon.split(",")
    cfg = TieredConfig(a.ns, daemon=daemons[int(os.environ.get("RANK", "0")) % len(daemons)], peers=[x for x in a.peers.split(",") if x],
                       persist_url=a.url, persist_every=a.persist_every)
    out: dict = {"rank": int(os.environ.get("RANK", "0"))}
    if a.mode == "save":
        stalls = []
        for s in [int(x) for x in a.steps.split(",")]:
            sd = state(s, world, fill=True)
            t = time.perf_counter()
            api.save(sd, s, cfg)
            stalls.append(time.perf_counter() - t)
        out["stalls"] = stalls
        if a.ready_file:
            print(json.dumps(out), flush=True)
            open(f"{a.ready_file}.{out['rank']}", "w").close()
            time.sleep(3600)
    else:
        sd = state(0, world, fill=False)
        try:
            reader = api.load(sd, cfg, step=a.step)
        except NoCheckpointError as e:
            out["error"] = f"{type(e).__name__}: {e}"
            print(json.dumps(out), flush=True)
            return 0
        out.update(step=reader.step, tier=reader.ref.tier, tiers_used=sorted(reader.tiers_used),
                   fallbacks=reader.fallbacks, ok=same(sd, state(reader.step, world, fill=True)))
    if world > 1:
        dist.destroy_process_group()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    # leave without interpreter teardown: gloo's threads can abort the process in their destructors
    # ("terminate called without an active exception": SIGABRT after a successful run, seen in CI)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
