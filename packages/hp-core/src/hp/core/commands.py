"""hp-core's sub-commands: ``hp run``, ``hp controller``, ``hp finish``, ``hp backends``, ``hp token``, ``hp k8s``."""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import sys
import time

from hp.core import auth
from hp.core.auth import read_token
from hp.core.config import (SECTIONS, ElasticConfig, FaultToleranceConfig, LaunchConfig, LoggingConfig, RendezvousConfig,
                            RunConfig, add_section_flags, check_name, check_port, check_seconds, parse_endpoint,
                            parse_nnodes, section_from_args)
from hp.core.errors import UsageError
from hp.core.plugins import load_scaler
from hp.core.hookspecs import hookimpl


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run this node's agent and workers (torchrun-like)")
    a = p.add_argument
    # the flags parsed by hand (a value that is not one field); every other flag comes from its config field
    a("--nnodes", default="1", help="number of nodes (agents) in the job, or MIN:MAX for an elastic job "
                                     "(starts with MIN; more nodes may join up to MAX; needs --scaling-policy)")
    a("--rdzv-endpoint", "--rdzv_endpoint", default=None,
      help="controller HOST:PORT; node 0 hosts it there unless --external-controller. With --store etcd: "
           "the etcd cluster, HOST[:PORT][,HOST[:PORT]...] (like torchrun's etcd rendezvous): the agents elect "
           "the controller among themselves and any of them takes over if its node dies (give every node "
           "the same --run-id)")
    a("--run-id", default=None, help="job id shared by every node (default: random)")
    a("--token-file", default=None, help=f"file holding the job token (default: ${auth.TOKEN_ENV})")
    for name, section in SECTIONS.items():
        add_section_flags(p, name, section)
    a("-m", "--module", action="store_true", help="run the entrypoint as a Python module")
    a("entrypoint", help="training script (or module with -m)")
    a("args", nargs=argparse.REMAINDER, help="arguments for the training script")
    p.set_defaults(handler=_run)


def run_config(args: argparse.Namespace) -> RunConfig:
    """``hp run``'s flags as a :class:`RunConfig` (validated)."""
    nnodes, max_nnodes = parse_nnodes(args.nnodes)
    if max_nnodes is not None and args.scaling_policy is None:
        raise UsageError("--nnodes MIN:MAX makes an elastic job: give its --scaling-policy FILE")
    etcd, endpoint = args.store == "etcd", args.rdzv_endpoint
    launch = {"entrypoint": args.entrypoint, "args": list(args.args), "module": args.module, "nnodes": nnodes}
    if args.run_id:
        launch["run_id"] = args.run_id
    cfg = RunConfig(
        launch=section_from_args(LaunchConfig, args, launch),
        fault_tolerance=section_from_args(FaultToleranceConfig, args),
        elastic=section_from_args(ElasticConfig, args, {"max_nnodes": max_nnodes}),
        rendezvous=section_from_args(
            RendezvousConfig, args, {"rdzv_endpoint": parse_endpoint(endpoint) if endpoint and not etcd else None,
                                     "store_endpoint": _etcd_endpoint(endpoint) if endpoint and etcd else None}),
        logging=section_from_args(LoggingConfig, args),
    )
    cfg.validate()
    return cfg


def _run(args: argparse.Namespace) -> int:
    cfg = run_config(args)
    scaler = load_scaler(cfg.elastic.scaling_policy) if cfg.elastic.scaling_policy is not None else None
    token = read_token(args, required=cfg.launch.nnodes > 1 or (cfg.elastic.max_nnodes or 1) > 1
                       or cfg.rendezvous.external_controller)
    from hp.core.agent import Agent  # imports torch: only once the arguments are known to be good

    if cfg.launch.start_method == "forkserver":  # forked from this process, before it starts its threads
        from hp.core import fork_context

        fork_context.fork_here(cfg.worker_thread_env())
    _exit_now(Agent(cfg, token, scaler).run())


def _exit_now(code: int) -> None:
    """End ``hp run``'s process once its node is done: ``atexit`` handlers run and the standard streams are
    flushed, as at any exit, but the interpreter's teardown of torch's modules (~1 CPU s on the 2-core box)
    is skipped, and so is the wait for the node relay's last store read (up to ``RELAY_WAIT_S``), whose
    thread would otherwise have to leave its C++ call before that teardown. The agent writes nothing
    buffered (every log line is opened, written and closed)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _etcd_endpoint(text: str) -> str:
    """``--rdzv-endpoint`` of an etcd cluster, checked: ``HOST[:PORT][,HOST[:PORT]...]``."""
    from hp.core.etcd_store import parse_endpoints

    try:
        endpoints = parse_endpoints(text)
    except ValueError as e:
        raise UsageError(f"--rdzv-endpoint: expected etcd HOST[:PORT][,HOST[:PORT]...], got {text!r} ({e})") from None
    for host, port in endpoints:
        if not host or any(c.isspace() or c in "/?#@" for c in host) or not 0 < port <= 65535:
            raise UsageError(f"--rdzv-endpoint: bad etcd member {host}:{port} in {text!r}")
    return text


def _add_controller(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("controller", help="run a job's controller (and its store) standalone")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback)")
    p.add_argument("--port", type=int, default=29400)
    p.add_argument("--nnodes", required=True, help="nodes in the job, or MIN:MAX for an elastic job")
    p.add_argument("--scaling-policy", default=None, metavar="FILE", help="elastic: a ScalingPolicy YAML (hp-elastic)")
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--heartbeat-timeout", type=float, default=30.0)
    p.add_argument("--store", default="tcp", help="coordination store plugin")
    p.add_argument("--rdzv-endpoint", default=None,
                   help="with --store etcd: the etcd cluster HOST[:PORT][,...]; this process is then one replica "
                        "of the job's controller (run several: one leads, the others take over if it dies)")
    p.add_argument("--run-id", default=None, help="with --rdzv-endpoint: the job (as every node's `hp run --run-id`)")
    p.add_argument("--lease", type=int, default=2, help="HA replicas: seconds of the leader's lease in etcd")
    p.add_argument("--decision-log", default=None, help="append decisions to this JSON-lines file")
    p.add_argument("--token-file", default=None)
    p.set_defaults(handler=_controller)


def _controller(args: argparse.Namespace) -> int:
    from hp.core.control_plane import ControlServer
    from hp.core.controller import Controller, ControllerConfig, ElasticController
    from hp.core.plugins import get_backend
    from hp.core.protocol import JobState
    from hp.core.signed_values import sealing

    nnodes, max_nnodes = parse_nnodes(args.nnodes)
    if nnodes < 1 or (max_nnodes is not None and max_nnodes < nnodes):
        raise UsageError(f"--nnodes must be >= 1 (MIN <= MAX), got {args.nnodes}")
    check_port(args.port, "--port")
    check_seconds(args.heartbeat_timeout, "--heartbeat-timeout")
    if args.max_restarts < 0 or args.lease < 1:
        raise UsageError(f"--max-restarts must be >= 0 and --lease >= 1, got {args.max_restarts} and {args.lease}")
    if (max_nnodes is None) != (args.scaling_policy is None):
        raise UsageError("an elastic job needs both --nnodes MIN:MAX and --scaling-policy FILE")
    scaler = load_scaler(args.scaling_policy) if args.scaling_policy is not None else None
    token = read_token(args, required=True)
    if args.rdzv_endpoint is not None:
        return _controller_replica(args, nnodes, max_nnodes, scaler, token)
    try:  # an address this machine does not have, a port in use: one line, not a traceback
        store = get_backend("store", args.store).serve(args.host, 0)
    except (OSError, RuntimeError) as e:
        raise UsageError(f"--host {args.host}: cannot listen there: {str(e).splitlines()[0] if str(e) else e!r}") from None
    config = ControllerConfig(
        nnodes=nnodes, max_nodes=max_nnodes, max_restarts=args.max_restarts, heartbeat_timeout_s=args.heartbeat_timeout,
        store_host=store.host, store_port=store.port, decision_log=args.decision_log,
    )
    publish = sealing(store.store.set, token)  # workers act only on values sealed with the job token
    controller = (Controller(config, publish=publish) if scaler is None
                  else ElasticController(config, scaler, publish=publish))
    try:
        server = ControlServer(controller, token, args.host, args.port).start()
    except OSError as e:
        store.close()
        raise UsageError(f"--host {args.host} --port {args.port}: cannot listen there: {e.strerror or e}") from None
    print(f"hp controller: listening on {server.endpoint}, store on {store.host}:{store.port}", flush=True)
    stop = []
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda signum, frame: stop.append(signum))
    try:
        while not stop and controller.state not in (JobState.SUCCEEDED, JobState.FAILED):
            time.sleep(0.1)
        time.sleep(1.0)  # let agents read the final state before the server goes away
    finally:
        server.stop()
        store.close()
    print(f"hp controller: job {controller.state.value} {controller.reason}".rstrip(), flush=True)
    return 0 if controller.state is JobState.SUCCEEDED else 1


def _controller_replica(args: argparse.Namespace, nnodes: int, max_nnodes: int | None, scaler, token: str) -> int:
    """``hp controller --store etcd --rdzv-endpoint ETCD --run-id JOB``: one replica of the job's HA
    controller (:mod:`hp.core.leader`); it serves while it leads and waits while another does."""
    from hp.core.controller import Controller, ControllerConfig, ElasticController
    from hp.core.etcd_store import DEFAULT_PORT
    from hp.core.leader import ControllerReplica
    from hp.core.plugins import get_backend
    from hp.core.protocol import JobState
    from hp.core.signed_values import sealing

    if args.store != "etcd":
        raise UsageError(f"--rdzv-endpoint: controller replicas keep the job's state in etcd: --store etcd, not {args.store!r}")
    if not args.run_id:
        raise UsageError("--rdzv-endpoint needs the job's --run-id (the one every node's `hp run` is given)")
    check_name(args.run_id, "--run-id")
    if args.lease < 1:
        raise UsageError(f"--lease must be >= 1 s, got {args.lease}")
    endpoints = _etcd_endpoint(args.rdzv_endpoint)
    backend = get_backend("store", "etcd")
    store = backend.connect(endpoints, DEFAULT_PORT, job=args.run_id)

    def make(persist):
        config = ControllerConfig(nnodes=nnodes, max_nodes=max_nnodes, max_restarts=args.max_restarts,
                                  heartbeat_timeout_s=args.heartbeat_timeout, store_host=endpoints,
                                  store_port=DEFAULT_PORT, decision_log=args.decision_log)
        publish = sealing(store.set, token)
        return (Controller(config, publish=publish, persist=persist) if scaler is None
                else ElasticController(config, scaler, publish=publish, persist=persist))

    say = lambda line: print(f"hp controller: {line}", flush=True)  # noqa: E731
    replica = ControllerReplica(store, token, make, args.host, args.port, node=f"replica-{args.port}",
                                ttl_s=args.lease, say=say).start()
    stop: list[int] = []
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda signum, frame: stop.append(signum))
    final = None
    try:
        while not stop and replica.error is None:
            c = replica.controller
            if c is not None and c.state in (JobState.SUCCEEDED, JobState.FAILED):
                final = c
                time.sleep(1.0)  # let agents read the final state before the server goes away
                break
            time.sleep(0.1)
    finally:
        replica.stop()
    if final is None:
        print(f"hp controller: replica stopped{': ' + str(replica.error) if replica.error else ''}", flush=True)
        return 1 if replica.error else 0
    print(f"hp controller: job {final.state.value} {final.reason}".rstrip(), flush=True)
    return 0 if final.state is JobState.SUCCEEDED else 1


def _add_backends(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("backends", help="list every discovered plugin backend")
    p.add_argument("--json", action="store_true", help="print a JSON list of {family, name, dist}")
    p.set_defaults(handler=_backends)


def _backends(args: argparse.Namespace) -> int:
    from hp.core.plugins import list_backends

    infos = list_backends()
    if args.json:
        print(json.dumps([i.as_dict() for i in infos]))
    else:
        width = max((len(i.name) for i in infos), default=4)
        fam = max((len(i.family) for i in infos), default=6)
        print(f"{'FAMILY':<{fam}} {'NAME':<{width}} DIST")
        for i in infos:
            print(f"{i.family:<{fam}} {i.name:<{width}} {i.dist}")
    return 0


def _add_token(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("token", help=f"print a new random job token (for {auth.TOKEN_ENV})")
    p.set_defaults(handler=lambda args: print(auth.new_token()) or 0)


def _add_k8s(sub: argparse._SubParsersAction) -> None:
    from hp.core.schedulers.k8s.cli import add_parser  # `hp k8s manifest`: no kubernetes client needed

    add_parser(sub)


def _add_finish(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("finish", help="end a running job after the next step boundary its ranks agree on "
                                      "(every rank after the same step; the job succeeds)")
    p.add_argument("--rdzv-endpoint", required=True, help="the job's controller HOST:PORT")
    p.add_argument("--reason", default="an operator", help="said in the controller's decision log")
    p.add_argument("--token-file", default=None, help="file holding the job token (default: $HP_JOB_TOKEN)")
    p.set_defaults(handler=_finish)


def _finish(args: argparse.Namespace) -> int:
    from hp.core.control_plane import request_finish

    endpoint = parse_endpoint(args.rdzv_endpoint)
    answer = request_finish(str(endpoint), read_token(args, required=True), args.reason)
    print(json.dumps(answer))
    return 0


@hookimpl
def hp_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    for add in (_add_run, _add_controller, _add_backends, _add_token, _add_k8s, _add_finish):
        add(subparsers)
