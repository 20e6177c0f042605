"""The router's tie-break seed and the trainer's fit seed are separate settings: one
`ELDR_SEED` used to set both."""

from __future__ import annotations

import pytest

from eldr.training.trainer import TrainerConfig
from eldr_services.router.settings import RouterSettings
from eldr_services.trainer.settings import TrainerSettings


def test_each_service_reads_its_own_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELDR_ROUTER_SEED", "7")
    monkeypatch.setenv("ELDR_SEED", "11")
    assert RouterSettings().router_seed == 7
    trainer = TrainerSettings()
    assert trainer.seed == 11
    assert TrainerConfig.from_settings(trainer).seed == 11


def test_the_fit_seed_leaves_the_routers_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELDR_SEED", "5")
    assert RouterSettings().router_seed == 0
