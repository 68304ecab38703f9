"""One rank of a real gloo group for test_state.py: `state_worker.py suite|sender_dies RANK WORLD PORT OUTDIR`.

Writes OUTDIR/rank{RANK}.json with what it observed; the test compares ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hp.checkpointless import state as st
from hp.checkpointless import transfer as tx


class Net(torch.nn.Module):
    """Small, but with mixed dtypes: float32 params, int64 BN counter, a bfloat16 buffer."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.fc1, self.bn = torch.nn.Linear(8, hidden), torch.nn.BatchNorm1d(hidden)
        self.fc2 = torch.nn.Linear(hidden, 4)
        self.register_buffer("scale", torch.ones(4, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x)))) * self.scale.float()


def build(hidden: int = 16) -> tuple[Net, torch.optim.Optimizer, Any]:
    model = Net(hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def train_step(model: Net, opt: torch.optim.Optimizer, sched: Any) -> float:
    """Uses all three RNGs, so a wrongly restored RNG shows up as a different loss."""
    x = torch.randn(16, 8) + float(np.random.rand()) + random.random()
    loss = (model(x) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def digest(state: Any) -> str:
    skeleton, tensors = st.flatten(state)
    h = hashlib.sha256(json.dumps(skeleton, sort_keys=True).encode())
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def counting(name: str) -> list[int]:
    """Wrap torch.distributed.<name> (which state.py looks up at call time) to count calls."""
    calls, real = [0], getattr(dist, name)

    def wrapped(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        return real(*a, **k)

    setattr(dist, name, wrapped)
    return calls


def live_ptrs(model: Net, opt: torch.optim.Optimizer) -> list[int]:
    return [p.data_ptr() for p in model.parameters()] + [t.data_ptr() for s in opt.state.values() for t in s.values()]


def error(fn: Any) -> str:
    try:
        fn()
    except st.StateTransferError as e:
        return str(e)
    return "NO ERROR"


def transfer(rank: int, res: dict) -> None:
    extra = {"step": 3, "ids": {1: "a"}, "pair": (1, 2.5)}
    if rank == 0:
        torch.manual_seed(0), random.seed(0), np.random.seed(0)
        model, opt, sched = build()
        for _ in range(3):
            train_step(model, opt, sched)
        sends = counting("isend")
        tx.send_state(st.capture(model, opt, sched, extra), 1)
        res["digest"] = digest(st.capture(model, opt, sched, extra))
        res["sends"] = [sends[0]]
        res["loss"] = train_step(model, opt, sched)
        for n in (1, 300):  # 3 messages whatever the tensor count
            sends[0] = 0
            tx.send_state({f"t{i}": torch.full((i % 5 + 1,), float(i)) for i in range(n)}, 1)
            res["sends"].append(sends[0])
        tx.send_state(st.capture(model, opt, sched, extra), 1)  # into the receiver's template
        res["digest2"] = digest(st.capture(model, opt, sched, extra))
        res["loss2"] = train_step(model, opt, sched)
        tx.send_state({"w": torch.zeros(3)}, 1)  # receiver's template has shape [2]
        tx.send_state({"w": torch.ones(2)}, 1)  # the group is still in sync afterwards
    else:
        torch.manual_seed(123), random.seed(1), np.random.seed(1)
        model, opt, sched = build()  # fresh: the optimizer has no state yet
        recvs = counting("irecv")
        got = tx.recv_state(0)
        res["recvs"] = [recvs[0]]
        restored_extra = st.restore(got, model, opt, sched)
        res["extra"] = repr(restored_extra)
        res["digest"] = digest(st.capture(model, opt, sched, restored_extra))
        res["loss"] = train_step(model, opt, sched)
        for n in (1, 300):
            recvs[0] = 0
            got = tx.recv_state(0)
            res["recvs"].append(recvs[0])
            assert len(got) == n and got[f"t{n - 1}"].tolist() == [float(n - 1)] * ((n - 1) % 5 + 1)
        template = st.capture(model, opt, sched, restored_extra)
        ptrs = [t.data_ptr() for t in st.flatten({"m": template["model"], "o": template["optimizer"]})[1]]
        live = live_ptrs(model, opt)
        got = tx.recv_state(0, template=template)
        after = [t.data_ptr() for t in st.flatten({"m": got["model"], "o": got["optimizer"]})[1]]
        st.restore(got, model, opt, sched)
        res["ptrs_same"] = ptrs == after and live == live_ptrs(model, opt) and len(ptrs) > 10
        res["digest2"] = digest(st.capture(model, opt, sched, restored_extra))
        res["loss2"] = train_step(model, opt, sched)
        res["mismatch"] = error(lambda: tx.recv_state(0, template={"w": torch.zeros(2)}))
        res["after_mismatch"] = tx.recv_state(0)["w"].tolist()


def corrupt(rank: int, res: dict) -> None:
    cases = ["buffer_flip", "json_flip", "bad_magic", "bad_version", "header_crc", "absurd_len", "over_limit",
             "bad_skeleton"]
    state = {"a": torch.arange(1000, dtype=torch.float64), "b": [torch.ones(3, dtype=torch.bfloat16)]}
    if rank == 0:
        for case in cases:
            frames = st.encode(state)
            header = frames[0]
            if case == "buffer_flip":
                frames[2][77] ^= 0x10
            elif case == "json_flip":
                frames[1][3] ^= 0x01
            elif case == "bad_magic":
                header[0] = 1234
            elif case == "bad_version":
                header[1] = 99
            elif case == "header_crc":
                header[3] += 8
            elif case == "absurd_len":
                header[3] = 1 << 50
            elif case == "bad_skeleton":
                payload = json.dumps({"s:a": {"__tensor__": 0, "dtype": "load", "shape": [1]}}).encode()
                frames[1] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                crcs = st.zlib.crc32(payload), st.checksum(frames[2])
                header = frames[0] = st._header(len(payload), frames[2].numel(), *crcs)
            if case in ("absurd_len",):
                st._seal(header)
            header_only = case in ("bad_magic", "bad_version", "header_crc", "absurd_len", "over_limit")
            for t in frames[:1] if header_only else frames:
                dist.send(t, 1)
        tx.send_state({"ok": torch.tensor([1, 2, 3])}, 1)
    else:
        allocs = [0]
        real_alloc = st._alloc

        def counted(n: int) -> torch.Tensor:
            allocs[0] += 1
            return real_alloc(n)

        st._alloc = counted
        for case in cases:
            allocs[0] = 0
            t0 = time.monotonic()
            limit = 1024 if case == "over_limit" else st.DEFAULT_MAX_BYTES
            res[case] = error(lambda: tx.recv_state(0, max_bytes=limit))
            res[case + "_allocs"] = allocs[0]
            res[case + "_s"] = time.monotonic() - t0
        res["ok_after"] = tx.recv_state(0)["ok"].tolist()
        st._alloc = real_alloc


def sender_dies(rank: int, res: dict, out: Path) -> None:
    if rank == 0:
        frames = st.encode({"w": torch.randn(2_000_000)})
        dist.send(frames[0], 1)  # header only, then die like a SIGKILLed rank
        (out / "rank0.json").write_text(json.dumps({"header_sent": True}))
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        tx.recv_state(0)
        res["error"] = "NO ERROR"
    except RuntimeError as e:
        res["error"], res["type"] = str(e), type(e).__name__
    res["elapsed"] = time.monotonic() - t0


def broadcast(rank: int, res: dict) -> None:
    calls = counting("broadcast")
    if rank == 0:
        torch.manual_seed(0), random.seed(0), np.random.seed(0)
        model, opt, sched = build(hidden=32)
        train_step(model, opt, sched)
        tx.broadcast_state(st.capture(model, opt, sched), src=0)
        res["digest"] = digest(st.capture(model, opt, sched))
        train_step(model, opt, sched)
        buf = st.StateBuffer.for_layout(st.flatten(st.capture(model, opt, sched))[0], prefault=True)
        ptr = buf.data.data_ptr()
        tx.broadcast_state(st.capture(model, opt, sched), src=0, buffer=buf)
        res["buffer_reused"] = buf.data.data_ptr() == ptr
    else:
        torch.manual_seed(rank), random.seed(rank), np.random.seed(rank)
        model, opt, sched = build(hidden=32)
        st.restore(tx.broadcast_state(None, src=0), model, opt, sched)
        res["digest"] = digest(st.capture(model, opt, sched))
        train_step(model, opt, sched)  # both sides step: states agree again
        template = st.capture(model, opt, sched)
        buf = st.StateBuffer.for_layout(st.flatten(template)[0], prefault=True)
        ptr = buf.data.data_ptr()
        before = [p.data_ptr() for p in model.parameters()]
        got = tx.broadcast_state(None, src=0, template=template, buffer=buf)
        st.restore(got, model, opt, sched)
        res["buffer_reused"] = buf.data.data_ptr() == ptr and before == [p.data_ptr() for p in model.parameters()]
    res["calls"] = calls[0]
    res["digest2"] = digest(st.capture(model, opt, sched))


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[5])
    rank, world, port = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    timeout = timedelta(seconds=5 if scenario == "sender_dies" else 30)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    res: dict = {}
    if scenario == "sender_dies":
        sender_dies(rank, res, out)
    else:  # "suite": one group, several scenarios, so the tests pay for importing torch once
        for name, fn in (("transfer", transfer), ("corrupt", corrupt)):
            if rank < 2:
                res[name] = {}
                fn(rank, res[name])
            dist.barrier()
        res["broadcast"] = {}
        broadcast(rank, res["broadcast"])
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    if scenario == "sender_dies":
        os._exit(0)  # the peer is gone: don't let teardown wait on it
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
