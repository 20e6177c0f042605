"""The pipeline's roles, written once and called by every place that plays them.

A role is the I/O-free logic of one part of the pipeline: the prefill producer (capture state,
step results, local summaries, PrefillDone), the requester (decision waiters, finish tracking,
in-flight accounting), signature assembly (`signature`) and the router's event handling
(`router`: load reports, decision records, expiry). The capture plugin, the gateway, the
services and the simulator all call these; none of them keeps its own copy. Transport (NATS,
HTTP) stays with the callers: a role takes and returns messages and values.
"""
