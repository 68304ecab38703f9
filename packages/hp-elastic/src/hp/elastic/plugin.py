"""hp-elastic's plugin: the scaling decision the controller asks (``hp_scaler``) and the ``hp scale`` command.

Registered under the ``hp`` entry-point group. Never imports torch (the ``hp`` CLI loads every plugin).
"""

from __future__ import annotations

import argparse
import json

from hp.core.hookspecs import hookimpl
from hp.core.scaling import CAPACITY, FAILURE, PREEMPTION, ScaleEvent, ScaleTarget
from hp.elastic.decide import CapacityChanged, Failure, Preemption, decide
from hp.elastic.policy import ScalingPolicy



class PolicyScaler:
    """:class:`hp.core.scaling.Scaler` over a :class:`ScalingPolicy` (the pure :func:`decide` does the work)."""

    def __init__(self, policy: ScalingPolicy) -> None:
        self.policy = policy
        self.min_replicas, self.max_replicas, self.unit = policy.min_replicas, policy.max_replicas, policy.unit

    def target(self, world: int, capacity: int, event: ScaleEvent) -> ScaleTarget:
        kinds = {FAILURE: lambda: Failure(event.count), PREEMPTION: lambda: Preemption(event.count),
                 CAPACITY: CapacityChanged}
        decision = decide(self.policy, world, max(0, capacity), kinds[event.kind]())
        return ScaleTarget(decision.world, decision.reason)


@hookimpl
def hp_scaler(policy: str) -> PolicyScaler:
    return PolicyScaler(ScalingPolicy.from_yaml(policy))


def _scale(args: argparse.Namespace) -> int:
    from hp.core.auth import OPERATOR
    from hp.core.auth import read_token
    from hp.core.config import parse_endpoint
    from hp.core.control_plane import ControlClient
    from hp.core.errors import UsageError
    from hp.core.protocol import Verb

    if args.replicas < 0:
        raise UsageError(f"--replicas must be >= 0, got {args.replicas}")
    endpoint = parse_endpoint(args.rdzv_endpoint)
    token = read_token(args, required=True)
    answer = ControlClient(str(endpoint), token, node=OPERATOR).call(Verb.SCALE, {"replicas": args.replicas})
    print(json.dumps(answer))
    return 0


@hookimpl(trylast=True)  # after hp-checkpointless added `hp demo`, which this extends with --elastic
def hp_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("scale", help="set an elastic job's capacity: it shrinks to (at a step boundary) "
                                            "or grows into N ranks")
    p.add_argument("--rdzv-endpoint", required=True, help="the job's controller HOST:PORT")
    p.add_argument("--replicas", type=int, required=True, help="ranks the job may use now")
    p.add_argument("--token-file", default=None, help="file holding the job token (default: $HP_JOB_TOKEN)")
    p.set_defaults(handler=_scale)
    demo = subparsers.choices.get("demo")
    if demo is not None:
        demo.add_argument("--elastic", action="store_true",
                          help="the elastic demo (hp-elastic): a fixed-size reference, then the job going 4 -> 3 (kill, "
                               "no spare) -> 4 (grow) -> 2 (preempt a node) -> 4, compared bit for bit")
        demo.add_argument("--float", action="store_true", help="with --elastic: the float all-reduce, not exact mode")
        fixed, steps = demo.get_default("handler"), demo.get_default("steps")
        demo.set_defaults(handler=lambda args: _demo_elastic(args, fixed, steps))


def _demo_elastic(args: argparse.Namespace, fixed_size_demo, default_steps: int) -> int:
    if not args.elastic:
        return fixed_size_demo(args)
    from hp.elastic.demo.run import ElasticDemoConfig, format_table, run_elastic_demo

    # the fixed-size demo's default step count is too short for four scale events
    steps = args.steps if args.steps != default_steps else ElasticDemoConfig.steps
    result = run_elastic_demo(ElasticDemoConfig(steps=steps, model_size=args.model_size, log_dir=args.log_dir,
                                                exact=not args.float, train_args=["--zero"] if args.zero else []))
    print(format_table(result))
    if result.get("error_tail"):
        print("\nlast output of the failed job:\n" + result["error_tail"])
    if args.json:
        print(json.dumps(result))
    ok = result["completed"] and result["lost_steps"] == 0 and (result["bitwise_equal"] or not result["exact"])
    return 0 if ok else 1
