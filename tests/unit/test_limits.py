"""Geometry limits from configuration (`eldr.core.limits`, issue 15 finding 3)."""

from __future__ import annotations

import pytest

from eldr.core.limits import GeometryLimits, parse_model_geometries
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
