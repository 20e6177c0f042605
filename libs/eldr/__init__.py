"""ELDR: expert-locality-aware decode routing for PD-disaggregated MoE serving.

`eldr.core` is the pure algorithm library (numpy/hnswlib/stdlib only); the other
subpackages add I/O around it. Process entry points live in `eldr_services`.
"""

__version__ = "0.1.0"
