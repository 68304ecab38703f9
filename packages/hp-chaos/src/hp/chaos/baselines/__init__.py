"""Baselines that hp's numbers are compared against: the traditional way the same job recovers.

Each baseline is a real training script driven by the real launcher (no simulation), writing the
same kind of JSON-lines event log as hp's runtime, so one analysis measures every variant.
"""
