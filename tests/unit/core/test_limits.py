"""Geometry limits from configuration (`eldr.core.limits`, issue 15 finding 3)."""

from __future__ import annotations

import numpy as np
import pytest

from eldr.core.limits import GeometryLimits, parse_model_geometries
from eldr.core.partition.partition import Partition, geometry_problem
from eldr.core.signature.signature import Calibration
from eldr.settings import GeometrySettings


def test_the_caps_refuse_each_dimension_and_their_product() -> None:
    limits = GeometryLimits(max_moe_layers=64, max_experts=512, max_cells=16_384)
    assert limits.problem("m", 58, 256) is None  # DeepSeek-V3
    assert "65 MoE layers" in (limits.problem("m", 65, 8) or "")
    assert "1024 experts" in (limits.problem("m", 2, 1024) or "")
    assert "= 32768 cells" in (limits.problem("m", 64, 512) or "")


def test_a_configured_model_needs_exactly_its_geometry() -> None:
    limits = GeometryLimits(models={"tiny": (4, 16)})
    assert limits.problem("tiny", 4, 16) is None
    assert "configured as 4 x 16" in (limits.problem("tiny", 4, 17) or "")
    assert limits.problem("other", 8, 8) is None  # within the caps
    assert "not one of" in (GeometryLimits(only_listed=True).problem("other", 8, 8) or "")


def test_a_message_that_names_no_model_is_held_to_the_caps_alone() -> None:
    limits = GeometryLimits(models={"tiny": (4, 16)}, only_listed=True)
    assert limits.problem(None, 8, 8) is None
    assert "65 MoE layers" in (GeometryLimits(max_moe_layers=64).problem(None, 65, 8) or "")


def test_the_active_partition_rules_for_its_own_model_only() -> None:
    """The one check the router and the trainer make (`geometry_problem`)."""
    active = Partition(
        version=3,
        model="tiny",
        calibration=Calibration(4, 16, "raw", None, np.ones(4, bool)),
        centroids=np.eye(2, 64, dtype=np.float32),
        owners=np.array([0, 1]),
        workers=("d0", "d1"),
    )
    limits = GeometryLimits(models={"tiny": (8, 8)})  # the active version wins for its model
    assert geometry_problem(active, limits, "tiny", 4, 16) is None
    assert "partition version 3 of 'tiny' is 4 x 16" in (
        geometry_problem(active, limits, "tiny", 8, 8) or ""
    )
    assert geometry_problem(active, limits, "other", 8, 8) is None
    assert geometry_problem(active, limits, None, 8, 8) is None  # a profile: the caps
    assert "configured as 8 x 8" in (geometry_problem(None, limits, "tiny", 4, 16) or "")


def test_the_default_limits_refuse_the_329_byte_event() -> None:
    # The event of finding 3 declared 256 MoE layers x 65,536 experts.
    assert GeometryLimits().problem("m", 256, 65_536) is not None


def test_model_geometries_parse_and_refuse_nonsense() -> None:
    assert parse_model_geometries(" a=48x128, org/b-7b=4X16 ,") == {
        "a": (48, 128),
        "org/b-7b": (4, 16),
    }
    for bad in ("a=48", "=4x4", "a=0x4", "a=4x4,a=4x4", "a=4x-1"):
        with pytest.raises(ValueError):  # noqa: PT011 - each says why
            parse_model_geometries(bad)
    with pytest.raises(ValueError, match="model=LAYERSxEXPERTS"):
        GeometrySettings(model_geometries="nonsense")
    settings = GeometrySettings(model_geometries="a=4x16", max_signature_cells=100)
    assert settings.geometry_limits() == GeometryLimits(max_cells=100, models={"a": (4, 16)})
