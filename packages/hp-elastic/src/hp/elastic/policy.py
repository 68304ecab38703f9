"""The scaling policy: which world sizes a job may run at, its batch geometry and its learning rate.

A :class:`ScalingPolicy` is a frozen config dataclass, built in Python or loaded from a YAML file
(:meth:`ScalingPolicy.from_yaml`, :meth:`ScalingPolicy.from_dict`). Every bad value is a
:class:`hp.core.errors.UsageError` with a one-line message, which the ``hp`` CLI prints and exits 2 on.

Sizes. A job runs at one of :meth:`ScalingPolicy.sizes_allowed`: either the explicit ``sizes`` list
or every multiple of ``unit`` from ``min_replicas`` to ``max_replicas``.

Batch. Exactly one of two rules:

* ``global_batch`` (constant global batch, the default way): a step is ``global_batch`` samples in
  ``global_batch // micro_batch`` micro-batches of ``micro_batch`` samples whatever the world size; an
  override may change the micro-batch size at one world size (the global batch never changes, so the
  number of micro-batches does).
* ``replica_batch`` (per-replica batch, the global batch follows the world size): each replica computes
  ``replica_batch // micro_batch`` micro-batches a step, so a step at W replicas is ``W * replica_batch``
  samples. Where a step starts in the sample stream then depends on the world sizes of every step before
  it: the runtime keeps that position as committed state (``ctx.samples``), hydrates it to joiners and
  saves it in checkpoints, so nothing is skipped or repeated across scale events.

Learning rate. ``lr_rule`` is ``constant`` (the default: the right rule with a constant global batch),
``linear`` or ``sqrt`` (``lr * W / base_world`` or ``lr * sqrt(W / base_world)``: with a per-replica
batch, the global batch and so the LR follow W) or ``table`` (``lr_table[W]``, absolute). A
per-world-size override ``lr`` wins over the rule.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from hp.core.errors import UsageError

LR_RULES = ("constant", "linear", "sqrt", "table")


@dataclass(frozen=True)
class WorldOverride:
    """Settings for one world size that differ from the policy's defaults."""

    micro_batch: int | None = None
    lr: float | None = None


@dataclass(frozen=True)
class ScalingPolicy:
    """Where a job's world size may go and what the batch and the LR are at each size."""

    min_replicas: int
    max_replicas: int
    micro_batch: int
    global_batch: int | None = None  # samples per step at every world size (constant global batch)
    replica_batch: int | None = None  # samples per replica per step (the global batch follows W)
    unit: int = 1
    sizes: tuple[int, ...] | None = None  # discrete world sizes; None: multiples of unit in [min, max]
    lr: float | None = None  # the base LR that lr_rule scales (not needed with lr_rule "table")
    lr_rule: str = "constant"
    base_world: int | None = None  # the world size ``lr`` was tuned at (linear, sqrt); default min_replicas
    lr_table: Mapping[int, float] = field(default_factory=dict)
    overrides: Mapping[int, WorldOverride] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.global_batch is None) == (self.replica_batch is None):
            raise UsageError("scaling policy: give exactly one of global_batch (constant global batch) and "
                             "replica_batch (per-replica batch)")
        for name in ("min_replicas", "max_replicas", self.batch_key, "micro_batch", "unit"):
            _positive_int(name, getattr(self, name))
        if self.base_world is not None:
            _positive_int("base_world", self.base_world)
        if self.min_replicas > self.max_replicas:
            raise UsageError(f"scaling policy: min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        if self.sizes is not None:
            object.__setattr__(self, "sizes", _sizes(self.sizes, self))
        for name in ("min_replicas", "max_replicas"):
            if self.sizes is None and getattr(self, name) % self.unit:
                raise UsageError(f"scaling policy: unit {self.unit} does not divide {name} {getattr(self, name)}")
        _divides(self.batch_key, "micro_batch", self.micro_batch, self.batch)
        if self.lr_rule not in LR_RULES:
            raise UsageError(f"scaling policy: unknown lr_rule {self.lr_rule!r} (known: {', '.join(LR_RULES)})")
        if self.lr is not None:
            _positive_float("lr", self.lr)
        allowed = set(self.sizes_allowed())
        table = {_world_key("lr_table", w, allowed): _positive_float(f"lr_table[{w}]", v)
                 for w, v in dict(self.lr_table).items()}
        object.__setattr__(self, "lr_table", table)
        if self.lr_rule == "table" and (missing := sorted(allowed - set(table))):
            raise UsageError(f"scaling policy: lr_rule 'table' but lr_table lacks world sizes {missing}")
        overrides: dict[int, WorldOverride] = {}
        for w, o in dict(self.overrides).items():
            w = _world_key("overrides", w, allowed)
            o = o if isinstance(o, WorldOverride) else _override(w, o)
            if o.micro_batch is not None:
                _positive_int(f"overrides[{w}].micro_batch", o.micro_batch)
                _divides(self.batch_key, f"overrides[{w}].micro_batch", o.micro_batch, self.batch)
            if o.lr is not None:
                _positive_float(f"overrides[{w}].lr", o.lr)
            overrides[w] = o
        object.__setattr__(self, "overrides", overrides)

    # -- sizes and batch ------------------------------------------------------------------------

    def sizes_allowed(self) -> tuple[int, ...]:
        """Every world size the job may run at, increasing."""
        if self.sizes is not None:
            return self.sizes
        return tuple(range(self.min_replicas, self.max_replicas + 1, self.unit))

    def allows(self, world: int) -> bool:
        return world in self.sizes_allowed()

    def largest_at_most(self, n: int) -> int | None:
        """The largest allowed world size ≤ ``n``; None when even the smallest is bigger."""
        fits = [w for w in self.sizes_allowed() if w <= n]
        return fits[-1] if fits else None

    def micro_batch_for(self, world: int) -> int:
        o = self.overrides.get(world)
        return o.micro_batch if o is not None and o.micro_batch is not None else self.micro_batch

    @property
    def batch_key(self) -> str:
        """Which batch rule the policy has: ``global_batch`` or ``replica_batch``."""
        return "global_batch" if self.global_batch is not None else "replica_batch"

    @property
    def batch(self) -> int:
        """The policy's batch: the global one, or the per-replica one (:attr:`batch_key` says which)."""
        return self.global_batch if self.global_batch is not None else self.replica_batch

    def micro_batches_for(self, world: int) -> int:
        """M: micro-batches per step at ``world`` (all ranks together)."""
        if self.global_batch is not None:
            return self.global_batch // self.micro_batch_for(world)
        return world * (self.replica_batch // self.micro_batch_for(world))

    def global_batch_for(self, world: int) -> int:
        """Samples per step at ``world``."""
        return self.micro_batches_for(world) * self.micro_batch_for(world)

    # -- learning rate --------------------------------------------------------------------------

    def lr_for(self, world: int) -> float:
        """The learning rate at ``world``: the override's, else the rule's."""
        if world <= 0:
            raise UsageError(f"scaling policy: world size must be positive, got {world}")
        o = self.overrides.get(world)
        if o is not None and o.lr is not None:
            return o.lr
        if self.lr_rule == "table":
            if world not in self.lr_table:
                raise UsageError(f"scaling policy: lr_table has no entry for world size {world}")
            return self.lr_table[world]
        if self.lr is None:
            raise UsageError(f"scaling policy: lr_rule {self.lr_rule!r} needs lr (the base learning rate)")
        base = self.base_world if self.base_world is not None else self.min_replicas
        if self.lr_rule == "linear":
            return self.lr * world / base
        if self.lr_rule == "sqrt":
            return self.lr * math.sqrt(world / base)
        return self.lr

    # -- loading --------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: Any, source: str = "scaling policy") -> ScalingPolicy:
        """Build from a mapping (a parsed YAML document); unknown keys are an error naming them."""
        if not isinstance(raw, Mapping):
            raise UsageError(f"{source}: expected a mapping of policy keys, got {type(raw).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in raw if k not in known)
        if unknown:
            raise UsageError(f"{source}: unknown keys {', '.join(unknown)} (known: {', '.join(known)})")
        missing = [k for k in ("min_replicas", "max_replicas", "micro_batch") if k not in raw]
        if "global_batch" not in raw and "replica_batch" not in raw:
            missing.append("global_batch (or replica_batch)")
        if missing:
            raise UsageError(f"{source}: missing keys {', '.join(missing)}")
        kw = dict(raw)
        if kw.get("sizes") is not None:
            if not isinstance(kw["sizes"], (list, tuple)):
                raise UsageError(f"{source}: sizes must be a list of world sizes")
            kw["sizes"] = tuple(kw["sizes"])
        for key in ("lr_table", "overrides"):
            if kw.get(key) is None:
                kw.pop(key, None)
            elif not isinstance(kw[key], Mapping):
                raise UsageError(f"{source}: {key} must map world sizes to values")
        try:
            return cls(**kw)
        except UsageError as e:
            msg = str(e).removeprefix("scaling policy: ")
            raise UsageError(f"{source}: {msg}") from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> ScalingPolicy:
        import yaml

        try:
            with open(path, encoding="utf-8") as f:
                raw = yaml.safe_load(f)
        except FileNotFoundError:
            raise UsageError(f"scaling policy file {os.fspath(path)} does not exist") from None
        except OSError as e:
            raise UsageError(f"scaling policy file {os.fspath(path)}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise UsageError(f"scaling policy file {os.fspath(path)}: not UTF-8 text") from None
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            at = f" (line {where.line + 1})" if where is not None else ""
            raise UsageError(f"scaling policy file {os.fspath(path)}: invalid YAML{at}") from None
        return cls.from_dict(raw, source=f"scaling policy file {os.fspath(path)}")


# -- validation helpers --------------------------------------------------------------------------


def _positive_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise UsageError(f"scaling policy: {name} must be an integer, got {v!r}")
    if v <= 0:
        raise UsageError(f"scaling policy: {name} must be positive, got {v}")
    return v


def _positive_float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise UsageError(f"scaling policy: {name} must be a positive number, got {v!r}")
    return float(v)


def _divides(batch_key: str, name: str, micro: int, batch: int) -> None:
    if batch % micro:
        raise UsageError(f"scaling policy: {batch_key} {batch} is not a multiple of {name} {micro}")


def _sizes(sizes: Any, p: ScalingPolicy) -> tuple[int, ...]:
    if not isinstance(sizes, (list, tuple)) or not sizes:
        raise UsageError(f"scaling policy: sizes must be a non-empty list of world sizes, got {sizes!r}")
    out = tuple(sorted({_positive_int("sizes[]", s) for s in sizes}))
    if bad := [s for s in out if s % p.unit]:
        raise UsageError(f"scaling policy: unit {p.unit} does not divide sizes {bad}")
    if bad := [s for s in out if not p.min_replicas <= s <= p.max_replicas]:
        raise UsageError(f"scaling policy: sizes {bad} lie outside [{p.min_replicas}, {p.max_replicas}]")
    return out


def _world_key(what: str, w: Any, allowed: set[int]) -> int:
    if isinstance(w, str) and w.strip().isdigit():
        w = int(w)
    if isinstance(w, bool) or not isinstance(w, int) or w not in allowed:
        raise UsageError(f"scaling policy: {what} key {w!r} is not an allowed world size {sorted(allowed)}")
    return w


def _override(w: int, o: Any) -> WorldOverride:
    if not isinstance(o, Mapping):
        raise UsageError(f"scaling policy: overrides[{w}] must be a mapping with micro_batch and/or lr")
    unknown = sorted(str(k) for k in o if k not in ("micro_batch", "lr"))
    if unknown:
        raise UsageError(f"scaling policy: overrides[{w}] has unknown keys {', '.join(unknown)} (known: micro_batch, lr)")
    return WorldOverride(micro_batch=o.get("micro_batch"), lr=o.get("lr"))
