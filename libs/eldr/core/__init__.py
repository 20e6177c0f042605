"""Pure ELDR core: traces, block summaries, signatures, partitions, routing, cost model.

Rules for everything under this package: import only numpy, hnswlib, msgspec (the routing
profile's typed structs, `routing/profile.py`) and the standard library; no sockets, files,
clocks or global random state. Time and randomness come in as arguments (a float
`now_s`, a `numpy.random.Generator`).
"""
