"""Peer hydration wire: in-process unit tests, then real gloo groups of 2-3 processes (state_worker.py)."""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hp.checkpointless import state as st
from hp.testing import free_port
from hp.core.warm_start import python_command

WORKER = Path(__file__).with_name("state_worker.py")


def same(a: Any, b: Any) -> bool:
    """Exact equality that also tells tuple from list, int key from str key, and tensor dtypes apart."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if type(a) is not type(b) and not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(type(k) is type(j) for k, j in zip(a, b)) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def stepped_adamw() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def wire(frames: list[torch.Tensor]) -> st.Op:
    """A fake transport: each receive copies the next frame (so receive runs without processes)."""
    it = iter(frames)
    return lambda t: t.copy_(next(it))


def test_flatten_roundtrip_through_json_with_adamw_state() -> None:
    _, opt = stepped_adamw()
    state = {"opt": opt.state_dict(), "misc": (1, 2.5, None, "x", True, [float("inf")]), 7: {3: torch.tensor(1)}}
    skeleton, tensors = st.flatten(state)
    back = st.unflatten(json.loads(json.dumps(skeleton)), tensors)
    assert same(back, state)
    assert list(back["opt"]["state"]) == [0, 1, 2, 3]  # int parameter keys stay ints
    assert isinstance(back["opt"]["param_groups"][0]["betas"], tuple)
    assert back["opt"]["state"][0]["step"].dtype == torch.float32 and back["opt"]["state"][0]["step"].dim() == 0
    placeholder = skeleton["s:opt"]["s:state"]["i:0"]["s:exp_avg"]
    assert placeholder == {"__tensor__": 1, "dtype": "float32", "shape": [3, 4]}


def test_flatten_refuses_what_json_cannot_carry() -> None:
    with pytest.raises(TypeError, match="/a/0: cannot ship object"):
        st.flatten({"a": [object()]})
    with pytest.raises(TypeError, match="dict key 1.5"):
        st.flatten({"a": {1.5: 1}})


def test_state_buffer_mixed_dtypes_alignment_views_and_reuse() -> None:
    tensors = [torch.randn(3, dtype=torch.float32), torch.randn(2, 2, dtype=torch.float64).t(),
               torch.arange(5), torch.arange(7, dtype=torch.uint8), torch.randn(3, dtype=torch.bfloat16),
               torch.tensor(True), torch.empty(0, 3), torch.tensor(2.5, dtype=torch.float64)]
    skeleton, _ = st.flatten({"t": tensors})
    buf = st.StateBuffer.for_layout(skeleton, prefault=True)
    ptr = buf.data.data_ptr()
    flat = buf.pack(tensors)
    assert flat.dtype == torch.uint8 and flat.is_contiguous() and flat.numel() % 8 == 0
    assert all(o % max(8, dt.itemsize) == 0 for o, (_, dt, _) in zip(buf.offsets, buf.specs))
    views, copies = buf.unpack(), buf.unpack(copy=True)
    assert all(same(v, t) and same(c, t) for v, c, t in zip(views, copies, tensors))
    assert all(ptr <= v.data_ptr() < ptr + buf.nbytes for v in views if v.numel())  # views alias the buffer
    crc = st.checksum(flat)
    buf.pack([t + 1 if t.dtype != torch.bool else ~t for t in tensors])  # reuse: no new storage
    assert buf.data.data_ptr() == ptr and views[0].equal(tensors[0] + 1) and same(copies[0], tensors[0])
    assert st.checksum(flat) != crc
    with pytest.raises(ValueError, match="layout wants"):
        buf.pack([torch.zeros(4)] + tensors[1:])


def test_checksum_catches_one_bit_and_reads_any_dtype() -> None:
    t = torch.randn(1000, dtype=torch.bfloat16)
    u = t.clone()
    u.view(torch.uint8)[123] ^= 1
    assert st.checksum(t) != st.checksum(u) and st.checksum(t) == st.checksum(t.clone())


def test_capture_restore_in_process_including_fresh_optimizer() -> None:
    import numpy as np

    def setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any) -> float:
        loss = model(torch.randn(3, 4) * random.random() * float(np.random.rand())).pow(2).mean()
        loss.backward(), opt.step(), sched.step(), opt.zero_grad()
        return loss.item()

    torch.manual_seed(0)
    fresh = setup()
    other = setup()
    st.restore(st.capture(*fresh), *other)  # no step yet: optimizer 'state' is empty, still restores
    step(*fresh)
    frames = st.encode(st.capture(*fresh, extra={"epoch": 1}))
    expected = step(*fresh)  # draws from the captured RNG states
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    got = st.receive(wire(frames), 0, None, None, st.DEFAULT_MAX_BYTES)
    assert st.restore(got, *other) == {"epoch": 1}
    assert step(*other) == expected
    assert other[1].state_dict()["state"][0]["exp_avg"].equal(fresh[1].state_dict()["state"][0]["exp_avg"])


def test_no_partial_state_when_template_does_not_match() -> None:
    frames = st.encode({"a": torch.ones(2), "b": torch.ones(3)})
    template = {"a": torch.zeros(2), "b": torch.zeros(4)}
    with pytest.raises(st.StateTransferError, match="dtype/shape mismatch"):
        st.receive(wire(frames), 0, template, None, st.DEFAULT_MAX_BYTES)
    assert template["a"].equal(torch.zeros(2))  # checks run before any copy


# ---------------------------------------------------------------- real processes, real gloo


def run(scenario: str, world: int, out: Path, timeout: float = 120) -> tuple[dict[int, dict], list[int]]:
    """Start `world` ranks; a hang fails the test (and its processes are killed) instead of blocking."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    logs = [open(out / f"log{r}.txt", "w") for r in range(world)]
    procs = [subprocess.Popen(python_command([str(WORKER), scenario, str(r), str(world), str(port), str(out)]),
                              env=env, stdout=logs[r], stderr=subprocess.STDOUT) for r in range(world)]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
        for f in logs:
            f.close()
    codes = [p.returncode for p in procs]
    text = "\n".join(f"--- rank {r} (rc {c})\n{(out / f'log{r}.txt').read_text()[-3000:]}" for r, c in enumerate(codes))
    files = {r: out / f"rank{r}.json" for r in range(world)}
    results = {r: json.loads(f.read_text()) for r, f in files.items() if f.exists()}
    assert time.monotonic() < deadline, f"{scenario} hung\n{text}"
    assert len(results) == world, f"{scenario}: ranks missing results\n{text}"
    return results, codes


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """One 3-rank group runs the transfer, corruption and broadcast scenarios for the tests below, once
    per session even under xdist (a lock in the shared temp root): torch is imported 3 times, not 7."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if uid else base) / f"state_suite_{uid or 'local'}"
    root.mkdir(exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "done.json").exists():
            res, codes = run("suite", 3, root)
            assert codes == [0, 0, 0], codes
            (root / "done.json").write_text(json.dumps(res))
        return {int(r): v for r, v in json.loads((root / "done.json").read_text()).items()}


def test_transfer_model_adamw_scheduler_rng_is_bit_identical_in_3_messages(suite: dict[int, dict]) -> None:
    sender, receiver = suite[0]["transfer"], suite[1]["transfer"]
    assert receiver["digest"] == sender["digest"]  # model, optimizer, scheduler, 3 RNGs, extra
    assert receiver["loss"] == sender["loss"]  # the next step agrees exactly
    assert receiver["extra"] == repr({"step": 3, "ids": {1: "a"}, "pair": (1, 2.5)})
    assert sender["sends"] == [3, 3, 3] and receiver["recvs"] == [3, 3, 3]  # 1 and 300 tensors alike
    assert receiver["ptrs_same"]  # template receive wrote into the live params / optimizer state
    assert receiver["digest2"] == sender["digest2"] and receiver["loss2"] == sender["loss2"]
    assert "dtype/shape mismatch" in receiver["mismatch"] and receiver["after_mismatch"] == [1.0, 1.0]


def test_corrupt_or_absurd_payloads_are_rejected(suite: dict[int, dict]) -> None:
    r = suite[1]["corrupt"]
    assert "buffer checksum mismatch" in r["buffer_flip"]
    assert "JSON skeleton checksum mismatch" in r["json_flip"]
    assert "bad magic" in r["bad_magic"] and "version 99" in r["bad_version"]
    assert "header checksum mismatch" in r["header_crc"]
    assert "refusing to allocate" in r["absurd_len"] and r["absurd_len_allocs"] == 0
    assert "max_bytes=1024" in r["over_limit"] and r["over_limit_allocs"] == 0
    assert "malformed skeleton" in r["bad_skeleton"] and "unknown dtype 'load'" in r["bad_skeleton"]
    assert r["ok_after"] == [1, 2, 3]  # payload errors leave the stream in sync


def test_sender_killed_after_header_fails_fast(tmp_path: Path) -> None:
    res, codes = run("sender_dies", 2, tmp_path, timeout=60)
    assert codes[0] == -signal.SIGKILL and res[0] == {"header_sent": True}
    assert res[1]["type"] == "StateTransferError" and "json message" in res[1]["error"], res[1]
    assert res[1]["elapsed"] < 8  # PG timeout is 5 s; a reset peer is usually seen in well under 1 s


def test_broadcast_to_two_receivers_with_template_and_reused_buffer(suite: dict[int, dict]) -> None:
    res = {r: suite[r]["broadcast"] for r in range(3)}
    assert res[0]["digest"] == res[1]["digest"] == res[2]["digest"]
    assert res[0]["digest2"] == res[1]["digest2"] == res[2]["digest2"]
    assert all(res[r]["calls"] == 6 and res[r]["buffer_reused"] for r in range(3))
