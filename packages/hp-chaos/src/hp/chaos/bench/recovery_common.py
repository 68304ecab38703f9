"""What the variants of ``hp bench recovery`` share: the bench's config and how downtime is measured.

Apart from the bench (:mod:`hp.chaos.bench.recovery`) so that the baselines it runs
(:mod:`hp.chaos.baselines`: torchft, NVRx, elastic torchrun) measure the same way without importing it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from hp.core.protocol import Event

TORCHFT_HEARTBEAT_TIMEOUT_MS = 5000  # torchft's default: how long the Lighthouse counts a silent group as alive
MIN_STEPS_AFTER = 5  # steps from the fault on (F+1 included): bit-equality covers them all
MIN_REPEATS = 3  # the default: a figure to quote is a median with its spread (test_readme_figures)
VARIANTS = ("hp", "torchrun_dcp", "torchft", "nvrx_default", "nvrx_tuned")
HP_VARIANTS = {"hp": [], "hp_fsdp": ["--fsdp"]}  # hp's own: extra demo flags (hp_fsdp: only when asked for)


@dataclass
class BenchConfig:
    model_size: str = "25m"
    vocab: int | None = None  # None: 8192 for 25m (INFRA's ~25 M-param model), else 256 (bytes)
    seq: int = 64
    nproc: int = 2  # one rank per core on a 2-core box
    steps: int = 14
    fault_step: int = 6  # rank 1 dies right after committing this step
    ckpt_every: int = 4
    fault_rank: int = 1
    corpus_mb: int = 16
    seed: int = 0
    repeats: int = MIN_REPEATS
    pin: bool = True  # HP_PIN_CORES=1 for every variant's ranks
    variants: tuple[str, ...] = VARIANTS
    log_dir: str | None = None
    timeout_s: float = 900.0  # per job: a hang guard, not a measurement
    torchft_heartbeat_timeout_ms: int = TORCHFT_HEARTBEAT_TIMEOUT_MS  # torchft's default
    hang_timeout_s: float = 60.0  # hp's hang detector: a kill is seen by the collective, not by it

    @property
    def vocab_size(self) -> int:
        return self.vocab if self.vocab is not None else (8192 if self.model_size == "25m" else 256)

    def train_args(self) -> list[str]:
        """Arguments every training script takes: the same model shape and the same token cache."""
        return ["--vocab", str(self.vocab_size), "--seq", str(self.seq)]


def lost_time(to_next_step_s: float | None, step_time_s: float | None) -> float | None:
    """Downtime: fault -> every rank back at the step reached, minus the one step of new work that had
    to be done anyway (the variant's own median fault-free step time)."""
    return None if step_time_s is None or to_next_step_s is None else to_next_step_s - step_time_s


def median_step(commit_times: list[float]) -> float | None:
    """Median interval between consecutive commits (None with fewer than two)."""
    times = sorted(commit_times)
    return statistics.median(b - a for a, b in pairwise(times)) if len(times) > 1 else None


def every_rank_back(events: list[dict], t0: float, step: int, ranks: range, **match: Any) -> float | None:
    """Seconds from ``t0`` until every rank in ``ranks`` committed ``step`` (or a later one) after it:
    whoever holds a rank by then (a promoted spare, a restarted process). None if one never did."""
    firsts = []
    for r in ranks:
        hit = min((e["t"] for e in events if e["event"] == Event.COMMIT and e.get("rank") == r and e["t"] > t0
                   and e["step"] >= step and all(e.get(k) == v for k, v in match.items())), default=None)
        if hit is None:
            return None
        firsts.append(hit)
    return max(firsts) - t0


def phases(marks: dict[str, float | None]) -> dict[str, float]:
    """Seconds spent in each phase, from cumulative marks (seconds after the fault), as hp's demo does."""
    out, reached = {}, 0.0
    for name, mark in marks.items():
        if mark is not None:
            out[name] = max(0.0, mark - reached)
            reached = max(reached, mark)
    return out
