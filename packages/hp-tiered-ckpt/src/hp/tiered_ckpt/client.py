"""Typed client of a node daemon (:mod:`hp.tiered_ckpt.daemon`)."""

from __future__ import annotations

from hp.tiered_ckpt import wire


class DaemonClient:
    """Keeps one connection open (a save is three small exchanges; connecting each time costs
    more than the exchange on a busy node) and reconnects once if the daemon dropped it (it closes
    idle connections). ``admin_key`` (the daemon's ``<root>/admin.key``) signs ``peers`` and ``gc``,
    and every request when ``token`` is None."""

    def __init__(self, addr: tuple[str, int], token: str | None, timeout: float = 30.0,
                 admin_key: str | None = None) -> None:
        self.addr, self.token, self.timeout, self.admin_key = addr, token, timeout, admin_key
        self._sock = None

    def __repr__(self) -> str:
        return f"DaemonClient({self.addr[0]}:{self.addr[1]})"

    def _call(self, op: str, payload: bytes | None = None, limit: int = wire.MAX_HEADER,
              timeout: float | None = None, **kw) -> tuple[dict, bytes]:
        for attempt in (0, 1):
            fresh = self._sock is None
            try:
                if fresh:
                    self._sock = wire.connect(self.addr, self.timeout)
                self._sock.settimeout(timeout or self.timeout)
                key = self.admin_key if self.admin_key and (op in wire.ADMIN_OPS or not self.token) else self.token
                return wire.exchange(self._sock, key, {"op": op, **kw}, payload, limit=limit)
            except wire.RefusedError:
                raise
            except (OSError, wire.WireError):
                self.close()
                if fresh or attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def __del__(self) -> None:
        self.close()

    def ping(self) -> dict:
        return self._call("ping")[0]

    def slot(self, ns: str, rank: int, step: int, size: int) -> str:
        return self._call("slot", ns=ns, rank=rank, step=step, size=size, timeout=660)[0]["path"]

    def seal(self, ns: str, rank: int, step: int, world: int, path: str, size: int,
             spans: list[list[int]], persist_url: str | None, save_id: str) -> None:
        self._call("seal", ns=ns, rank=rank, step=step, world=world, path=path, size=size, spans=spans,
                   persist_url=persist_url, save_id=save_id)

    def commit(self, ns: str, step: int, world: int, meta: dict, meta_pickle: bytes,
               persist_url: str | None, save_id: str) -> None:
        self._call("commit", meta_pickle, ns=ns, step=step, world=world, meta=meta, persist_url=persist_url,
                   save_id=save_id)

    def steps(self, ns: str) -> list[dict]:
        return self._call("list", ns=ns)[0]["steps"]

    def manifest(self, ns: str, step: int) -> dict:
        return self._call("manifest", ns=ns, step=step)[0]

    def fetch(self, ns: str, step: int, rank: int, offset: int, length: int, save_id: str | None = None) -> bytes:
        return self._call("fetch", ns=ns, step=step, rank=rank, offset=offset, length=length, save_id=save_id,
                          limit=wire.MAX_PAYLOAD)[1]

    def gc(self, ns: str, keep: int) -> list[int]:
        return self._call("gc", ns=ns, keep=keep)[0]["removed"]

    def set_peers(self, peers: list[str]) -> list[list]:
        return self._call("peers", peers=peers)[0]["peers"]

    def status(self) -> dict:
        return self._call("status")[0]
