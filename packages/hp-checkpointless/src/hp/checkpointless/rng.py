"""Random number generator states as plain data (tensors, lists): captured at every commit,
restored before a replayed step, and copied to a replacement rank."""

from __future__ import annotations

import random
import sys
from typing import Any

import torch


def capture_rng() -> dict[str, Any]:
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(random.getstate())}
    np = sys.modules.get("numpy")
    if np is not None:  # only if the job uses numpy; importing it here would cost the import time
        name, keys, pos, has_gauss, cached = np.random.get_state()
        rng["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"].clone())  # a received view has a storage offset it would ignore
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in rng:
        import numpy as np

        name, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.clone() for t in rng["cuda"]])
