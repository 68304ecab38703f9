"""When a faulted run's bits are not the reference's: is the fault-free run itself reproducible?

A scenario's fault-free reference is run once per job and shared by every scenario of that job (the
session's :class:`hp.chaos.references.ReferenceCache`). If the job's numbers depend on more than its seed
(intra-op threads on a busy CPU: hp-checkpointless's README), one reference that came out other bits
fails every scenario of its job at once, each saying its recovery broke the bits. So when a scenario
that expects bit-identity gets other bits, the runner runs the fault-free job once more and says
which it is: the reference reproduces (the faults changed the bits) or it does not (the job is not
deterministic without faults). The scenario fails either way; this only names the cause.
"""

from __future__ import annotations

from collections.abc import Callable

from hp.checkpointless.demo.run import RunResult, compare_state, differing_steps

__all__ = ["reference_recheck"]


def reference_recheck(reference: RunResult, rerun: Callable[[], RunResult]) -> str:
    """One line: whether ``rerun()`` (the same fault-free job again) has ``reference``'s bits."""
    again = rerun()
    if again.returncode != 0:
        return f"a second fault-free run failed (exit {again.returncode}): reproducibility not checked"
    steps = differing_steps(reference, again)
    state = compare_state(reference, again)
    if not steps and state["state_equal"]:
        return "a second fault-free run has the reference's bits: the faults changed them"
    where = [f"steps {steps[:10]}"] if steps else []
    where += state["state_differences"][:2]
    return ("a second fault-free run does not have the reference's bits either (" + "; ".join(where) + "): the job "
            "is not deterministic without faults (intra-op threads? see hp-checkpointless's README)")
