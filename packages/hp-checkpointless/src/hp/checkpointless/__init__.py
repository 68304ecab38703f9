"""hp checkpointless recovery: in-process restart, step commit, hot spares, peer hydration, mmap data cache

Nothing public yet: this distribution is a skeleton until its issue lands.
"""

__all__: list[str] = []
