"""Benchmarks: trace-driven routing comparison and balanced K-means timing."""
