"""hp elastic training: scaling policy, constant global batch, LR per world size, graceful preemption

Nothing public yet: this distribution is a skeleton until its issue lands.
"""

__all__: list[str] = []
