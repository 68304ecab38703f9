"""What hp's fork server (:mod:`hp.core.forkserver`) imports before it forks a worker.

First, SIGTERM is blocked, before torch starts any thread: the server is a process of the node's job
step, and Slurm signals every process of a step at a preemption notice. A server that died of it would
leave the workers it forked re-parented, and they would take their agent for dead and exit mid-step
(:mod:`hp.core.worker_signals` is how the workers themselves leave that signal to the agent). The server
still ends with its agent: multiprocessing's server exits when the agent's end of its pipe closes.

Then what every worker imports (torch, its distributed and optimizer packages, and ``torch._dynamo``,
which the first ``Optimizer.add_param_group`` imports: ~3 of a worker's ~6 CPU s of start on the 2-core
box), and what the forked child runs. Last, :func:`gc.freeze`: what was imported is never traversed by
a child's garbage collections, and its pages stay shared with the server's.
"""

import signal

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

import gc  # noqa: E402

import torch  # noqa: E402, F401
import torch._dynamo  # noqa: E402, F401
import torch.distributed  # noqa: E402, F401
import torch.optim  # noqa: E402, F401

import hp.core.forkserver  # noqa: E402, F401

gc.freeze()
