"""``hp ckpt daemon|ls|verify|gc`` (``hp bench ckpt`` is hp-chaos's: :mod:`hp.chaos.bench.ckpt`).

Nothing heavy (torch) is imported while the parser is built: every ``hp`` invocation builds it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from hp.core.auth import check_token, token_from_env
from hp.core.config import check_name
from hp.core.errors import UsageError
from hp.core.privfs import private_dir, user_dir
from hp.tiered_ckpt import wire
from hp.core.hookspecs import hookimpl


def _addr(text: str, any_port: bool = False) -> tuple[str, int]:
    from hp.tiered_ckpt.wire import parse_addr

    try:
        return parse_addr(text, any_port)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _token() -> str:
    token = token_from_env()
    if not token:
        raise UsageError("set HP_JOB_TOKEN (the job token; `hp token` makes one)")
    return check_token(token, "the job token in $HP_JOB_TOKEN")


def _daemon(args: argparse.Namespace) -> int:
    from hp.tiered_ckpt.daemon import DaemonConfig, main

    if args.replicas < 0 or args.keep_memory < 0 or args.keep_persistent < 0:
        raise UsageError("--replicas, --keep-memory and --keep-persistent must be >= 0")
    peers = [_addr(p) for p in args.peers.split(",") if p] if args.peers else []
    if args.replicas > len(peers):
        print(f"hp ckpt daemon: warning: --replicas {args.replicas} but only {len(peers)} peers", file=sys.stderr)
    host, port = _addr(args.listen, any_port=True)
    try:  # the slots hold the job's weights: a directory only this user may enter
        root = private_dir(args.dir) if args.dir else user_dir("hp-ckpt")
    except OSError as e:
        raise UsageError(f"--dir {args.dir}: {e.strerror or e}") from None
    if not args.idle_timeout > 0 or not args.frame_timeout > 0:
        raise UsageError("--idle-timeout and --frame-timeout must be > 0 seconds")
    token = _token()
    admin_key = os.environ.get(wire.ADMIN_KEY_ENV) or None  # else the daemon makes one (<dir>/admin.key)
    if admin_key is not None and (len(admin_key) < 32 or admin_key == token):
        raise UsageError(f"{wire.ADMIN_KEY_ENV} must be at least 32 characters and differ from the job token")
    main(DaemonConfig(root=root, token=token, host=host, port=port, peers=peers,
                      replicas=args.replicas, keep_memory=args.keep_memory,
                      keep_persistent=args.keep_persistent, admin_key=admin_key,
                      idle_timeout_s=args.idle_timeout, frame_timeout_s=args.frame_timeout),
         ready_file=args.ready_file, parent_pid=args.parent_pid)
    return 0


def _target(args: argparse.Namespace):
    """The tier named on the command line: ``--url`` (persistent) or ``--daemon`` (memory)."""
    if bool(args.url) == bool(args.daemon):
        raise UsageError("give exactly one of --url URL (persistent tier) or --daemon HOST:PORT (memory tier)")
    check_name(args.namespace, "namespace")
    if args.url:
        from hp.tiered_ckpt.persist import PersistentTier

        try:
            tier = PersistentTier(args.url, args.namespace, _token())  # its manifests are signed with it
            found = tier.fs.exists(tier.root)
        except Exception as e:  # noqa: BLE001  an unknown protocol, a bucket we may not list, ...
            raise UsageError(f"--url {args.url}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                             ) from None
        if not found:
            raise UsageError(f"--url {args.url}: no such location")
        return tier
    from hp.tiered_ckpt.client import DaemonClient

    return DaemonClient(_addr(args.daemon), _token())


def _ls(args: argparse.Namespace) -> int:
    t = _target(args)
    if args.url:  # complete: committed, and every file the size its manifest says (a truncated upload is not)
        rows = [{"step": s, "tier": "persistent", "complete": ok and not t.size_problems(s)}
                for s, ok in sorted(t.steps().items())]
    else:
        rows = [{"step": s["step"], "tier": "memory", "complete": s["complete"], "world": s["world"],
                 "ranks": s["ranks"]} for s in t.steps(args.namespace)]
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(f"{r['step']:>10}  {r['tier']:<10}  {'complete' if r['complete'] else 'INCOMPLETE'}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    t = _target(args)
    if not args.url:
        raise UsageError("verify re-reads the persistent tier: give --url (the memory tier is verified on every read)")
    steps = [args.step] if args.step is not None else sorted(t.steps())
    if not steps:
        print(f"no steps of {args.namespace} at {args.url}: nothing to verify", file=sys.stderr)
        return 1
    bad = 0
    for s in steps:
        problems = t.verify(s)
        bad += bool(problems)
        print(f"step {s}: " + ("ok" if not problems else "BAD"))
        for p in problems:
            print(f"  {p}")
    return 1 if bad else 0


def _gc(args: argparse.Namespace) -> int:
    if args.keep < 1:
        raise UsageError(f"--keep must be >= 1 (gc keeps the newest complete steps; it never deletes a job's last "
                         f"one), got {args.keep}")
    if args.daemon and not args.url:  # signed with the daemon's admin key: the job token may not gc
        from hp.tiered_ckpt.client import DaemonClient

        check_name(args.namespace, "namespace")
        client = DaemonClient(_addr(args.daemon), token_from_env(), admin_key=_admin_key(args.admin_key_file))
        removed = client.gc(args.namespace, args.keep)
    else:
        removed = _target(args).gc(args.keep)
    print(json.dumps({"removed": removed}))
    return 0


def _admin_key(path: str | None) -> str:
    """The daemon's admin key from ``path``, default the key file of a daemon on the default
    ``--dir`` (``/dev/shm/hp-ckpt-<uid>/admin.key``); a missing or unreadable key is a UsageError."""
    if path is None:
        try:
            path = str(user_dir("hp-ckpt") / wire.ADMIN_KEY_FILE)
        except OSError as e:
            raise UsageError(f"--admin-key-file not given and the default directory is unusable: {e}") from None
    try:
        return wire.read_admin_key(path)
    except (OSError, ValueError) as e:
        raise UsageError(f"--admin-key-file {path}: {getattr(e, 'strerror', None) or e} (gc on a daemon needs "
                         f"its admin key: {wire.ADMIN_KEY_FILE} in the daemon's --dir)") from None


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("namespace", help="checkpoint namespace (one per job)")
    p.add_argument("--url", help="persistent tier URL (s3://bucket/prefix, file:///fsx/ckpt, /path)")
    p.add_argument("--daemon", help="a node daemon's HOST:PORT (memory tier)")
    p.add_argument("--json", action="store_true")


def add_daemon_args(d: argparse.ArgumentParser) -> None:
    d.add_argument("--listen", default=os.environ.get("HP_CKPT_DAEMON", "127.0.0.1:29480"), help="HOST:PORT to bind")
    d.add_argument("--dir", default=None, help="where shards live, a tmpfs (default /dev/shm/hp-ckpt-<uid>: "
                                               "0700, this user's only)")
    d.add_argument("--peers", default=os.environ.get("HP_CKPT_PEERS", ""), help="other nodes' daemons, ring order")
    d.add_argument("--replicas", type=int, default=1)
    d.add_argument("--keep-memory", type=int, default=2)
    d.add_argument("--keep-persistent", type=int, default=3)
    d.add_argument("--ready-file", default=None, help="write HOST:PORT here once listening")
    d.add_argument("--parent-pid", type=int, default=None, help="exit once this process is no longer the parent")
    d.add_argument("--idle-timeout", type=float, default=600.0,
                   help="close a connection with no request for this many seconds (clients reconnect)")
    d.add_argument("--frame-timeout", type=float, default=30.0,
                   help="a started request's header must arrive within this many seconds")
    d.set_defaults(handler=_daemon)


def _one_line(fn):
    """A tier that cannot be reached or answers nonsense is one line (exit 2), not a traceback."""
    def run(args: argparse.Namespace) -> int:
        where = args.url or args.daemon
        try:
            return fn(args)
        except (OSError, ValueError, KeyError, TypeError, wire.WireError) as e:
            raise UsageError(f"{where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    return run


@hookimpl(trylast=True)
def hp_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("ckpt", help="tiered checkpoints: node daemon, list, verify, gc")
    sub = p.add_subparsers(title="ckpt commands", metavar="CMD", required=True)
    add_daemon_args(sub.add_parser("daemon", help="the per-node memory-tier daemon"))
    for name, fn, text in (("ls", _ls, "steps per tier with completeness"),
                           ("verify", _verify, "re-check commit marker, sizes and checksums"),
                           ("gc", _gc, "apply retention: keep the newest --keep complete steps")):
        s = sub.add_parser(name, help=text)
        _add_target(s)
        s.set_defaults(handler=_one_line(fn))
        if name == "verify":
            s.add_argument("--step", type=int, default=None)
        if name == "gc":
            s.add_argument("--keep", type=int, required=True)
            s.add_argument("--admin-key-file", default=None,
                           help="with --daemon: the daemon's admin key (default: admin.key in the default --dir, "
                                "/dev/shm/hp-ckpt-<uid>)")
