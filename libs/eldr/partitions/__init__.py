"""Partition versions at rest: the blob codec, the writer that persists them, their CLI."""
