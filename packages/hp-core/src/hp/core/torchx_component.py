"""TorchX component: ``torchx run -s <scheduler> hp.run --script train.py`` launches ``hp run``.

Registered under the ``torchx.components`` entry point as the ``hp`` group, next to TorchX's own
``dist``/``utils``/``serve``/``metrics`` groups (torchx 0.7 hides its built-ins otherwise).
"""

import shlex
from typing import Dict, Optional

import torchx
from torchx import specs

from hp.core import auth


def run(
    *script_args: str,
    script: Optional[str] = None,
    m: Optional[str] = None,
    nnodes: int = 1,
    nproc_per_node: int = 1,
    max_restarts: int = 0,
    spares: int = 0,
    transport: str = "gloo",
    rdzv_port: int = 29400,
    image: str = torchx.IMAGE,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 1024,  # noqa: N803 (TorchX's resource naming)
    env: Optional[Dict[str, str]] = None,
    log_dir: Optional[str] = None,
    service: Optional[str] = None,
) -> specs.AppDef:
    """A training job under hp's agent: one ``hp run`` per node, workers restarted by hp's controller.

    Args:
        script_args: arguments passed to the training script
        script: training script to run (exactly one of script and m)
        m: Python module to run instead of a script
        nnodes: number of nodes; node 0 hosts the job controller
        nproc_per_node: worker processes per node
        max_restarts: worker restarts the job tolerates
        spares: hot spare processes per node (hp-checkpointless)
        transport: collective transport plugin (gloo or nccl)
        rdzv_port: controller port on node 0 for multi-node jobs
        image: image (for container schedulers); the working directory for local_cwd
        cpu: CPUs per node
        gpu: GPUs per node
        memMB: memory per node in MB
        env: extra environment variables for every node
        log_dir: directory for hp's worker logs
        service: a node service to start on every node, NAME[:KEY=VALUE,...] (e.g. ckpt)
    """
    if (script is None) == (m is None):
        raise ValueError("exactly one of --script and -m must be given")
    env = dict(env or {})
    cmd = [
        "hp", "run",
        "--nnodes", str(nnodes),
        "--nproc-per-node", str(nproc_per_node),
        "--max-restarts", str(max_restarts),
        "--spares", str(spares),
        "--transport", transport,
        "--run-id", specs.macros.app_id,
    ]
    if log_dir:
        cmd += ["--log-dir", log_dir]
    if service:
        cmd += ["--service", service]
    if nnodes > 1:
        # Every node must share one token; the controller address is node 0's, which TorchX's
        # schedulers expose through the rank0 environment variable (empty on node 0 itself).
        env.setdefault(auth.TOKEN_ENV, auth.new_token())
        cmd += ["--node-rank", specs.macros.replica_id, "--rdzv-endpoint", f"RANK0_HOST:{rdzv_port}"]
    cmd += ["-m", m] if m else [script]
    cmd += list(script_args)
    line = shlex.join(cmd).replace("RANK0_HOST", f"$${{{specs.macros.rank0_env}:=localhost}}")
    name = (m or script or "hp").rsplit("/", 1)[-1].removesuffix(".py").replace(".", "-")
    return specs.AppDef(
        name=name,
        roles=[
            specs.Role(
                name=name,
                image=image,
                entrypoint="bash",
                args=["-c", line],
                num_replicas=nnodes,
                resource=specs.resource(cpu=cpu, gpu=gpu, memMB=memMB),
                env=env,
                port_map={"hp-controller": rdzv_port},
            )
        ],
    )
