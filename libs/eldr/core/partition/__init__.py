"""Partitions of the signature space over decode workers: balanced K-means, assignment, index."""
