"""``hp bench``: every benchmark of hp against the traditional way to do the same, one module each.

The harness owns them (DESIGN.md, "Packages"): a benchmark drives jobs of hp-checkpointless, hp-elastic
or hp-tiered-ckpt, or hp-core's store and controller, and measures them; no production module imports
one. :mod:`hp.chaos.bench.cli` registers the command and its sub-commands; :mod:`hp.chaos.bench.meta`
is what every result carries (definition version, machine, load, spreads).

- ``recovery`` (:mod:`~hp.chaos.bench.recovery`, its table :mod:`~hp.chaos.bench.recovery_table`),
  ``goodput``, ``elastic`` (:mod:`~hp.chaos.bench.elastic`, on Slurm :mod:`~hp.chaos.bench.elastic_slurm`),
  ``exact``, ``step``, ``start``, ``hydrate``, ``ckpt``;
- ``init`` (with the HA controller's failover, :mod:`~hp.chaos.bench.failover`) and ``control`` (its
  simulated nodes, :mod:`~hp.chaos.bench.control_nodes`);
- ``all`` (:mod:`~hp.chaos.bench.suite`): the whole suite into one results file.
"""
