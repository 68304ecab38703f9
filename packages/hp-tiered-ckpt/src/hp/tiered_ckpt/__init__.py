"""hp tiered checkpointing: node memory tier with cross-node replicas, async fsspec persistence in DCP format

Nothing public yet: this distribution is a skeleton until its issue lands.
"""

__all__: list[str] = []
