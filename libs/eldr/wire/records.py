"""Wire records built from the routing core's results: one home for what a router commits.

`decision_record` turns a `RouteOutcome` (eldr.core.routing.decide) into the `Decision` a
router publishes, an assignment or (`expired_outcome`) the record of a request whose
requester stopped waiting: the router service commits it, and tests and the benchmarks that
need a router's records build them the same way.
"""

from __future__ import annotations

from eldr.core.routing.decide import RouteOutcome
from eldr.core.routing.profile import ProfileBase, as_routing_profile
from eldr.wire.arrays import SparseCounts
from eldr.wire.messages import NO_WORKER, Decision


def expired_outcome(profile: ProfileBase) -> RouteOutcome:
    """What a router records for a request whose requester stopped waiting (its event's
    deadline passed): no worker (`NO_WORKER`), nothing read, routed with `profile`."""
    return RouteOutcome(
        worker_id=NO_WORKER,
        profile=profile,
        partition_version=None,
        fallback=None,
        scores=(),
        band=(),
        loads=(),
    )


def decision_record(
    outcome: RouteOutcome,
    *,
    request_id: str,
    ts_s: float,
    router_id: str,
    model: str,
    signature: SparseCounts | None,
    missing_blocks: int,
    decide_s: float,
    prompt_tokens: int | None,
    client_request_id: str | None = None,
) -> Decision:
    """The `Decision` recording `outcome` (v4; an `expired_outcome` makes an "expired"
    record): the fleet where the decision read the whole fleet, else its candidates with
    the live-worker count and the fleet's load totals; the candidates' activity terms where
    the marginal-union scorer read them; the client's own id for the request as a label
    (`client_request_id`)."""
    considered = [tuple(row) for row in outcome.considered]
    partial = bool(considered) and not outcome.fleet
    return Decision(
        request_id=request_id,
        ts_s=ts_s,
        router_id=router_id,
        model=model,
        worker_id=outcome.worker_id,
        policy=outcome.policy,
        profile=as_routing_profile(outcome.profile),
        partition_version=outcome.partition_version,
        fallback=outcome.fallback,
        scores=list(outcome.scores),
        band=list(outcome.band),
        loads=[],
        signature=signature,
        missing_blocks=missing_blocks,
        decide_s=decide_s,
        rng_seed=outcome.rng_seed,
        fleet=list(outcome.fleet),
        prompt_tokens=prompt_tokens,
        considered=considered,  # type: ignore[arg-type]
        live_workers=outcome.live_workers if partial else None,
        fleet_totals=outcome.fleet_totals if partial else None,
        outcome="expired" if outcome.worker_id == NO_WORKER else "assigned",
        client_request_id=client_request_id,
    )
