"""The typed routing profile: one struct per policy, its constraints, the one mapping of loose
names onto it, and the settings that parse into it."""

from __future__ import annotations

import msgspec
import pytest
from pydantic import ValidationError

from eldr.core.routing.profile import (
    DEFAULT_PROFILE,
    PAPER_PROFILE,
    PROFILE_TYPES,
    ROUTER_POLICIES,
    EldrBandCostProfile,
    EldrBoundedProfile,
    EldrCostProfile,
    EldrProfile,
    JsqProfile,
    OracleProfile,
    RoundRobinProfile,
    RoutingProfile,
    decode_profile,
    encode_profile,
    params_taken,
    profile_from_params,
    validated,
)
from eldr.settings import RoutingSettings
from eldr_services.router.settings import RouterSettings
from eldr_services.trainer.settings import TrainerSettings


def test_every_policy_has_one_profile_tagged_by_its_name() -> None:
    assert list(PROFILE_TYPES) == [
        "round_robin",
        "random",
        "jsq",
        "p2c",
        "eldr",
        "eldr_bounded",
        "eldr_cost",
        "eldr_band_cost",
        "pipeline",
        "oracle",
    ]
    for name, kind in PROFILE_TYPES.items():
        assert kind().name == name
        assert msgspec.json.decode(encode_profile(kind()), type=RoutingProfile) == kind()
    assert "oracle" not in ROUTER_POLICIES


def test_the_band_rules_share_one_tau_default_and_the_default_is_banded_cost() -> None:
    assert EldrProfile().tau == EldrBoundedProfile().tau == OracleProfile().tau == 0.1
    assert EldrBandCostProfile().tau == 0.1
    assert (EldrBandCostProfile(), EldrProfile()) == (DEFAULT_PROFILE, PAPER_PROFILE)
    assert (PAPER_PROFILE.band_tau, DEFAULT_PROFILE.band_tau, JsqProfile().band_tau) == (
        0.1,
        0.1,
        None,
    )
    assert EldrCostProfile().band_tau is None


def test_what_a_policy_reads_is_its_profiles_to_say() -> None:
    assert (EldrProfile().uses_signature, EldrProfile().uses_activity) == (True, False)
    assert (EldrCostProfile().uses_activity, EldrCostProfile().wants_scores) == (True, False)
    assert EldrCostProfile(locality_weight=1.0).wants_scores
    assert RoundRobinProfile().stateful
    assert OracleProfile().scores_decode
    assert EldrCostProfile(top_k=2, prior_tokens=3.0).demand_model == (2, 3.0)
    default = EldrBandCostProfile()
    assert (default.uses_signature, default.uses_activity, default.fleet_scale) == (
        True,
        True,
        True,
    )
    assert not EldrProfile().fleet_scale


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"policy": "eldr", "tau": -0.1}', "tau"),
        ('{"policy": "eldr", "tau": 3}', "tau"),
        ('{"policy": "eldr_bounded", "slack": -1}', "slack"),
        ('{"policy": "eldr_cost", "prior_tokens": 0}', "prior_tokens"),
        ('{"policy": "eldr", "widen_to": 0}', "widen_to"),
        ('{"policy": "jsq", "load_measure": "inflight"}', "load_measure"),
        ('{"policy": "jsq", "tau": 0.1}', "unknown field `tau`"),
        ('{"policy": "domain"}', "policy"),
        ('{"tau": 0.1}', "policy"),
    ],
)
def test_a_bad_profile_is_refused_with_the_field_named(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        decode_profile(text)


def test_a_profile_built_in_code_is_checked_before_it_routes() -> None:
    assert validated(EldrProfile(tau=0.3)) == EldrProfile(tau=0.3)
    with pytest.raises(ValueError, match="tau"):
        validated(EldrProfile(tau=-1.0))


def test_loose_names_map_onto_a_profile_in_one_place() -> None:
    assert profile_from_params("eldr", {"tau": "0.2", "widen_to": 3.0}) == EldrProfile(
        tau=0.2, widen_to=3
    )
    kept = profile_from_params("eldr", {}, keep=EldrBoundedProfile(tau=0.3, slack=0.5))
    assert kept == EldrProfile(tau=0.3)  # slack is not eldr's
    with pytest.raises(ValueError, match=r"takes no parameter tau \(it takes: load_measure"):
        profile_from_params("jsq", {"tau": 0.1})
    with pytest.raises(ValueError, match="takes no parameter load_measure"):
        profile_from_params("round_robin", {"load_measure": "requests"})
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        profile_from_params("nope")
    assert params_taken("jsq", {"tau": 0.1, "load_measure": "kv_tokens"}) == {
        "load_measure": "kv_tokens"
    }


def test_describe_names_every_parameter() -> None:
    assert EldrProfile().describe() == "eldr (load_measure requests, tau 0.1, widen_to 2)"
    assert RoundRobinProfile().describe() == "round_robin"


def test_the_routing_profile_setting_takes_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELDR_ROUTING_PROFILE", '{"policy": "eldr_cost", "locality_weight": 60}')
    assert RouterSettings().routing_profile == EldrCostProfile(locality_weight=60.0)
    assert RoutingSettings().routing_profile == EldrCostProfile(locality_weight=60.0)


def test_the_older_variables_patch_the_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELDR_POLICY", "eldr")
    monkeypatch.setenv("ELDR_TAU", "0.2")
    monkeypatch.setenv("ELDR_LOAD_MEASURE", "kv_tokens")
    assert RouterSettings().routing_profile == EldrProfile(tau=0.2, load_measure="kv_tokens")
    monkeypatch.setenv("ELDR_ROUTING_PROFILE", '{"policy": "eldr_bounded", "slack": 0.3}')
    monkeypatch.delenv("ELDR_POLICY")
    assert RouterSettings().routing_profile == EldrBoundedProfile(
        tau=0.2, load_measure="kv_tokens", slack=0.3
    )


def test_an_older_variable_the_policy_does_not_take_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ELDR_POLICY", "eldr_cost")
    monkeypatch.setenv("ELDR_TAU", "0.2")  # eldr_cost has no band
    with pytest.raises(ValidationError, match="policy 'eldr_cost' takes no parameter tau"):
        RouterSettings()


def test_the_trainer_reads_the_routers_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELDR_ROUTING_PROFILE", '{"policy": "eldr", "tau": 0.3}')
    assert TrainerSettings().routing_profile == RouterSettings().routing_profile
    monkeypatch.setenv("ELDR_SHADOW_TAU", "0.3")  # its older spelling, agreeing
    assert TrainerSettings().routing_profile == EldrProfile(tau=0.3)
    monkeypatch.setenv("ELDR_TAU", "0.2")
    with pytest.raises(ValidationError, match=r"shadow_tau 0\.3 and tau 0\.2 differ"):
        TrainerSettings()
