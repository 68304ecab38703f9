"""hp chaos harness: fault plugins, scenarios, recovery and goodput benchmarks

Nothing public yet: this distribution is a skeleton until its issue lands.
"""

__all__: list[str] = []
