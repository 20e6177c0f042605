"""The whole pipeline as processes on real NATS and real PostgreSQL (the demo's flow).

2,000 requests from the traffic driver (400 calibration + 800 under round-robin + 800
under ELDR's band rule), then 800 more under the router's default policy, through 2 router
replicas and 2 signature replicas: every request gets exactly one decision, and the
simulated decode workers see a smaller expert union under both locality policies than
under round-robin on the same requests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from eldr.core.routing.profile import DEFAULT_PROFILE, EldrProfile, RoundRobinProfile
from eldr.core.workload.synthetic import SyntheticSpec
from eldr.dev.demo import DemoConfig, run_demo

# A workload with strong topic structure, so that 4 decode workers leave locality something
# to find: in the simulator (`eldr bench`) this spec gives the band rule -6.2% and the
# default policy -5.7% expert union against the best load-only baseline at batch 14 (the
# demo's default workload leaves about -1%, too little to tell from run-to-run noise).
CLUSTERED = SyntheticSpec(
    num_topics=4,
    num_moe_layers=24,
    num_experts=128,
    top_k=1,
    topic_specialisation=0.95,
    rho=0.9,
    popularity_skew=1.2,
)

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]


def test_requests_are_decided_exactly_once_and_locality_shrinks_the_expert_union(
    pg_url: str, tmp_path: Path
) -> None:
    result = run_demo(
        DemoConfig(
            decoders=4,
            calibration_requests=400,
            evaluation_requests=800,
            synthetic_requests=400,
            synthetic_spec=CLUSTERED,
            database_url=pg_url,
            state_dir=tmp_path,
            signature_replicas=2,
            router_replicas=2,
            policies=(RoundRobinProfile(), EldrProfile(), DEFAULT_PROFILE),
        )
    )
    assert result.requests_sent == 2800
    assert result.decisions_recorded == 2800
    rr, eldr, default = result.results
    assert (rr.policy, eldr.policy, default.policy) == ("round_robin", "eldr", DEFAULT_PROFILE.name)
    for r in (rr, eldr, default):
        assert r.sent == r.decided == 800
        assert r.lost == 0
        assert r.conflicting == 0
        assert r.finished == 800  # every request decoded by its simulated worker
    assert result.partition_version is not None
    assert eldr.fallbacks == {}  # every ELDR decision used the partition
    assert default.fallbacks == {}  # and every default decision the partition and signature
    assert eldr.expert_union_mean < rr.expert_union_mean
    assert default.expert_union_mean < rr.expert_union_mean
