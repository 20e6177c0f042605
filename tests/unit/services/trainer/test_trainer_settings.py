"""Trainer settings: the fixed worker list from the environment, defaults."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from eldr_services.trainer.settings import TrainerSettings


def test_fixed_workers_are_a_comma_separated_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELDR_TRAINER_WORKERS", "dw0, dw1,,dw2 ")
    assert TrainerSettings().trainer_workers == ("dw0", "dw1", "dw2")


def test_without_fixed_workers_the_list_is_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELDR_TRAINER_WORKERS", raising=False)
    assert TrainerSettings().trainer_workers == ()


@pytest.mark.parametrize("workers", ["dw0,dw0", "dw.0", "dw 0,dw1"])
def test_bad_worker_lists_are_refused(workers: str) -> None:
    with pytest.raises(ValidationError, match="trainer_workers"):
        TrainerSettings(trainer_workers=workers)  # type: ignore[arg-type]


def test_the_database_and_the_schedule_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ELDR_DATABASE_URL", "postgresql+psycopg://eldr@db/eldr")
    monkeypatch.setenv("ELDR_REFIT_INTERVAL_S", "0")
    settings = TrainerSettings()
    assert settings.database_url == "postgresql+psycopg://eldr@db/eldr"
    assert settings.refit_interval_s == 0
