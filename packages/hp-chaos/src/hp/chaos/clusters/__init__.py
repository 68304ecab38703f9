"""Real clusters on this host for the harness and the tests: a local Slurm (:mod:`hp.chaos.clusters.slurm`)
and its accounting (:mod:`hp.chaos.clusters.slurm_accounting`), so that a job meets a real scheduler's
preemption, quotas and node changes, not a fake of them."""
