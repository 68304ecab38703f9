"""hp chaos harness: fault plugins, scenarios, recovery and goodput benchmarks

Benchmarks so far: ``hp bench recovery`` (:mod:`hp.chaos.bench_recovery`), hp's in-process recovery
against torchrun + DCP checkpoint-restart on the same job. Modules are imported on demand: the
package itself stays importable without torch or hp-checkpointless.
"""

__all__: list[str] = []
