"""The demo job's workload flags, defined once: ``--seq --vocab --model-size --dropout --corpus-mb --seed``.

Every trainer of the demo model (``hp demo``'s and the elastic demo's jobs, the baselines' torchrun trainers)
and every benchmark that runs one takes the same six flags; each used to spell them, their types and
defaults on its own. A command adds the ones it takes with :func:`add_workload_args` (its own defaults and
help where they differ: ``hp bench recovery`` measures the 25m model by default) and hands them on to the
job it starts with :func:`workload_argv`. Importable without torch: the ``hp`` CLI builds its parsers with it.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from hp.checkpointless.demo.sizes import MODEL_SIZES


@dataclass(frozen=True)
class Workload:
    """The demo job's model and data: the defaults of ``hp.checkpointless.demo.train``."""

    seq: int = 64  # tokens per sample
    vocab: int = 256
    model_size: str = "tiny"  # a key of MODEL_SIZES
    dropout: float = 0.1
    corpus_mb: int = 16  # the synthetic corpus the node's token cache holds
    seed: int = 0  # of the corpus, the model's initialisation and the sampler


NAMES = tuple(f.name for f in fields(Workload))  # the flags' canonical order (as the demo job lists them)
_TYPES = {"seq": int, "vocab": int, "model_size": str, "dropout": float, "corpus_mb": int, "seed": int}


def flag(name: str) -> str:
    """``corpus_mb`` -> ``--corpus-mb``."""
    return "--" + name.replace("_", "-")


def add_workload_args(p: argparse.ArgumentParser, *names: str, choices: bool = False,
                      helps: Mapping[str, str] | None = None, **defaults: Any) -> None:
    """Add the workload flags ``names`` (default: all six, in :data:`NAMES` order) to ``p``, in the order
    given. ``defaults`` override :class:`Workload`'s per flag (``model_size="25m"``, ``vocab=None``);
    ``choices`` lets argparse refuse a ``--model-size`` outside :data:`MODEL_SIZES` (a command that
    reports that as its own one-line error leaves it off); ``helps`` gives a flag its help text."""
    unknown = (set(names) | set(defaults) | set(helps or {})) - set(NAMES)
    if unknown:
        raise ValueError(f"not a workload flag: {sorted(unknown)} (one of {', '.join(NAMES)})")
    base = Workload()
    for name in names or NAMES:
        kw: dict[str, Any] = {"default": defaults.get(name, getattr(base, name))}
        if name == "model_size" and choices:
            kw["choices"] = sorted(MODEL_SIZES)
        elif name != "model_size":
            kw["type"] = _TYPES[name]
        if helps and name in helps:
            kw["help"] = helps[name]
        p.add_argument(flag(name), **kw)


def workload_argv(source: Any, *names: str) -> list[str]:
    """The flags ``names`` (default: all six) with ``source``'s values (a namespace, a config: any object
    with those attributes) for the job a command starts; a None value is left out (the job's default)."""
    argv: list[str] = []
    for name in names or NAMES:
        value = getattr(source, name)
        if value is not None:
            argv += [flag(name), str(value)]
    return argv
