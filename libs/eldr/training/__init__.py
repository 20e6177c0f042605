"""The trainer: refits partitions from recent signatures and persists new versions; its CLI."""
