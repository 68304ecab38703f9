"""hp.core.auth: signed bodies, their freshness, and the replay window (each message accepted once)."""

from __future__ import annotations

import json
import threading

import pytest

from hp.core import auth

T0 = 1_000_000.0


def msg(nonce: str, ts: float = T0) -> dict:
    return {"nonce": nonce, "ts": ts}


def test_a_nonce_is_accepted_once():
    w = auth.ReplayWindow()
    w.check(msg("a" * 32), now=T0)
    w.check(msg("b" * 32), now=T0)
    with pytest.raises(auth.AuthError, match="already seen"):
        w.check(msg("a" * 32), now=T0 + 1)
    assert len(w) == 2


def test_nonces_are_forgotten_once_their_message_is_stale_anyway():
    w = auth.ReplayWindow(window_s=10)
    w.check(msg("a" * 32, ts=T0), now=T0)
    w.check(msg("b" * 32, ts=T0 + 5), now=T0 + 5)
    with pytest.raises(auth.AuthError):
        w.check(msg("a" * 32, ts=T0), now=T0 + 10)  # still within its window
    w.check(msg("c" * 32, ts=T0 + 11), now=T0 + 11)  # sweeps "a" (expired at T0+10), keeps "b"
    assert len(w) == 2
    with pytest.raises(auth.AuthError):
        w.check(msg("b" * 32, ts=T0 + 5), now=T0 + 11)
    w.check(msg("d" * 32, ts=T0 + 30), now=T0 + 30)
    assert len(w) == 1  # memory is bounded by the rate, not by the daemon's age


def test_a_nonce_is_kept_until_its_own_timestamp_expires_not_its_arrival():
    """A message stamped ahead (a clock skewed forward) stays replayable longer: kept longer."""
    w = auth.ReplayWindow(window_s=10)
    w.check(msg("a" * 32, ts=T0 + 9), now=T0)
    w.check(msg("b" * 32, ts=T0 + 15), now=T0 + 15)
    with pytest.raises(auth.AuthError, match="already seen"):
        w.check(msg("a" * 32, ts=T0 + 9), now=T0 + 15)


def test_a_full_window_refuses_rather_than_grows():
    w = auth.ReplayWindow(cap=3, window_s=10)
    for i in range(3):
        w.check(msg(f"{i:032d}"), now=T0)
    with pytest.raises(auth.AuthError, match="replay window full"):
        w.check(msg("x" * 32), now=T0 + 1)
    assert len(w) == 3
    w.check(msg("x" * 32, ts=T0 + 11), now=T0 + 11)  # the old ones expired: room again
    assert len(w) == 1


@pytest.mark.parametrize("bad", [{}, {"nonce": "short", "ts": T0}, {"nonce": 7, "ts": T0},
                                 {"nonce": "a" * 200, "ts": T0}, {"nonce": "a" * 32},
                                 {"nonce": "a" * 32, "ts": float("nan")}])
def test_a_message_without_a_usable_nonce_or_ts_is_refused(bad):
    with pytest.raises(auth.AuthError):
        auth.ReplayWindow().check(bad, now=T0)


def test_concurrent_checks_accept_each_nonce_once():
    w, accepted, lock = auth.ReplayWindow(), [], threading.Lock()

    def run() -> None:
        for i in range(500):
            try:
                w.check(msg(f"{i:032d}"), now=T0)
            except auth.AuthError:
                continue
            with lock:
                accepted.append(i)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(accepted) == list(range(500))


def test_a_nan_timestamp_is_not_fresh():
    """NaN compares false with everything: ``abs(now - nan) > skew`` let such a body through."""
    body = json.dumps({"ts": float("nan")}).encode()
    with pytest.raises(auth.AuthError, match="clock skew"):
        auth.verify_request("k", body, auth.sign("k", body))
