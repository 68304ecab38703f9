"""hp-checkpointless: in-process recovery of a training job with hot spares and peer hydration.

Wrap the training function with :func:`recoverable`, register the training state on the
:class:`Context` it receives and run each step inside ``with step:`` ending in ``ctx.commit(loss)``.
"""

from hp.checkpointless.faults import FaultPlan, InjectedFault
from hp.checkpointless.runtime import CollectiveError, Context, JobEnded, Step, recoverable

__all__ = ["CollectiveError", "Context", "FaultPlan", "InjectedFault", "JobEnded", "Step", "recoverable"]
