"""Configuration of tiered checkpointing for one training job (one namespace)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hp.core.auth import token_from_env
from hp.core.config import check_name
from hp.core.errors import UsageError
from hp.tiered_ckpt.wire import parse_addr

DAEMON_ENV = "HP_CKPT_DAEMON"      # this node's daemon, HOST:PORT
PEERS_ENV = "HP_CKPT_PEERS"        # other nodes' daemons, comma-separated HOST:PORT
URL_ENV = "HP_CKPT_URL"            # persistent tier, an fsspec URL


@dataclass
class TieredConfig:
    """Where and how often a job checkpoints.

    ``memory_every``/``persist_every`` are in steps: :func:`hp.tiered_ckpt.save` is a no-op on
    steps that are a multiple of neither. Retention (``keep_memory``, ``keep_persistent``) counts
    complete steps per tier; ``replicas`` copies of each node's shards go to the next nodes'
    daemons (``peers``, in ring order).
    """

    namespace: str
    daemon: str = "127.0.0.1:29480"
    peers: list[str] = field(default_factory=list)
    persist_url: str | None = None
    memory_every: int = 1
    persist_every: int = 10
    replicas: int = 1
    keep_memory: int = 2
    keep_persistent: int = 3
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_name(self.namespace, "checkpoint namespace")
        for name in ("memory_every", "persist_every"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("replicas", "keep_memory", "keep_persistent"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name} must be >= 0, got {getattr(self, name)}")
        try:
            for a in (self.daemon, *self.peers):
                parse_addr(a)
        except ValueError as e:
            raise UsageError(f"daemon address: {e}") from None
        self.token = self.token or token_from_env()
        if not self.token:
            raise UsageError("no job token: set HP_JOB_TOKEN (hp run sets it; `hp token` makes one)")

    @classmethod
    def from_env(cls, namespace: str, **overrides) -> TieredConfig:
        env = {"daemon": os.environ.get(DAEMON_ENV), "persist_url": os.environ.get(URL_ENV),
               "peers": [p for p in os.environ.get(PEERS_ENV, "").split(",") if p]}
        return cls(namespace=namespace, **{**{k: v for k, v in env.items() if v}, **overrides})

    def daemon_addr(self) -> tuple[str, int]:
        return parse_addr(self.daemon)

    def peer_addrs(self) -> list[tuple[str, int]]:
        return [parse_addr(p) for p in self.peers]
