"""The hydration payload on every device: a model and its AdamW state packed into the host-side flat buffer
a transfer sends (CUDA tensors staged through host memory), restored into a fresh model and optimizer on
the same device, bit for bit. The CPU suite runs it on the CPU; the ``gpu`` variant needs CUDA (run on a
GPU machine: ``pytest -m gpu``), as does the CUDA health check's."""

from __future__ import annotations

import pytest
import torch

from hp.checkpointless import state
from hp.checkpointless.registry import digest
from hp.core.health import CudaHealth

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]


def trained(device: str, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(16, 32, device=device)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


@pytest.mark.parametrize("device", DEVICES)
def test_state_travels_through_host_memory_and_is_restored_on_its_device(device):
    model, optimizer = trained(device, 3)
    sent = state.capture(model, optimizer)
    skeleton, tensors = state.flatten(sent)
    flat = state.StateBuffer(skeleton)
    flat.pack(tensors)  # what a transfer puts on the wire (or in a same-node receiver's memory)
    assert flat.data.device.type == "cpu"
    received = state.unflatten(skeleton, flat.unpack(copy=True))
    fresh, fresh_optimizer = trained(device, 0)  # a promoted spare: same model, an optimizer without state
    state.restore(received, fresh, fresh_optimizer)
    assert all(p.device.type == device for p in fresh.parameters())
    assert all(t.device.type == device for s in fresh_optimizer.state.values() for t in s.values() if t.dim())
    assert digest(state.capture(fresh, fresh_optimizer)["model"]) == digest(sent["model"])
    assert digest(fresh_optimizer.state_dict()) == digest(optimizer.state_dict())


@pytest.mark.gpu
@CUDA
def test_a_healthy_cuda_device_passes_its_check():
    assert CudaHealth().run("cuda:0") is None
