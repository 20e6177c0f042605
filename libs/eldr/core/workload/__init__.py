"""Workloads as data: traces, the synthetic generator and its fit, benchmark sizing."""
