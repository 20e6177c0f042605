"""The replay of a decision log: reproduce every decision on its recorded inputs
(`eldr.replay.reproduction`), then, when the configuration changes anything, re-decide the
same traffic under it (`eldr.replay.whatif`, with its modelled decode effect from
`eldr.replay.effect`); one `ReplayReport`. The recorded inputs both read are in
`eldr.replay.inputs`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from eldr.core.routing.decide import DecisionRng
from eldr.progress import NO_PROGRESS, Progress
from eldr.replay.eventlog import EventLog
from eldr.replay.inputs import PartitionCache, describe_recorded
from eldr.replay.reproduction import ReproductionReport, reproduce
from eldr.replay.whatif import CounterfactualReport, ReplayConfig, WhatIf


@dataclass
class ReplayReport:
    source: str
    namespace: str
    decisions: int
    first_ts_s: float | None
    last_ts_s: float | None
    recorded_policies: dict[str, int]
    reproduction: ReproductionReport
    counterfactual: CounterfactualReport | None
    notes: list[str]
    expired: int = 0
    """Expired records in the log (no worker assigned): not replayed."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (arrays dropped; plots read them from the objects)."""
        out = asdict(self)
        out["reproduction"]["checked"] = self.reproduction.checked
        out["reproduction"]["share"] = round(self.reproduction.share, 6)
        out["reproduction"]["complete"] = self.reproduction.complete
        cf = out.get("counterfactual")
        if cf is not None and self.counterfactual is not None:
            cf.pop("changed_at_s", None)
            cf.pop("decided_at_s", None)
            cf["changed_share"] = round(self.counterfactual.changed_share, 6)
            modelled = cf.get("modelled")
            if modelled is not None and self.counterfactual.modelled is not None:
                modelled.pop("tpot_before_ms", None)
                modelled.pop("tpot_after_ms", None)
                modelled["change_pct"] = self.counterfactual.modelled.change_pct()
        result: dict[str, Any] = _finite(out)
        return result


def _finite(value: Any) -> Any:
    """NaN and infinities as None (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


class Replayer:
    def __init__(
        self,
        event_log: EventLog,
        config: ReplayConfig | None = None,
        progress: Progress = NO_PROGRESS,
    ) -> None:
        """progress: one unit per decision reproduced and per decision replayed what-if."""
        self.log = event_log
        self.config = config or ReplayConfig()
        self.progress = progress
        self.partitions = PartitionCache(event_log, self.config.index_method)
        self._rngs = DecisionRng()

    def reproduce(self) -> ReproductionReport:
        return reproduce(
            self.log,
            self.partitions,
            self._rngs,
            max_listed=self.config.max_listed,
            progress=self.progress,
        )

    def counterfactual(self) -> CounterfactualReport:
        return WhatIf(self.log, self.config, self.partitions, self._rngs, self.progress).run()

    def run(self) -> ReplayReport:
        reproduction = self.reproduce()
        counterfactual = None
        if self.config.counterfactual:
            counterfactual = self.counterfactual()
        span = self.log.span_s()
        notes = list(self.log.notes) + sorted(set(self.partitions.errors.values()))
        return ReplayReport(
            source=self.log.source,
            namespace=self.log.namespace,
            decisions=len(self.log.decisions),
            first_ts_s=None if span is None else span[0],
            last_ts_s=None if span is None else span[1],
            recorded_policies=dict(Counter(describe_recorded(d) for d in self.log.decisions)),
            reproduction=reproduction,
            counterfactual=counterfactual,
            notes=notes,
            expired=len(self.log.expired),
        )


def replay(
    event_log: EventLog, config: ReplayConfig | None = None, progress: Progress = NO_PROGRESS
) -> ReplayReport:
    """Reproduce every decision of `event_log`, and replay it under `config` when that
    changes anything (`progress`: see `Replayer`)."""
    return Replayer(event_log, config, progress).run()


def replay_steps(event_log: EventLog, config: ReplayConfig) -> int:
    """Units of work `replay` reports to its progress."""
    return len(event_log.decisions) * (2 if config.counterfactual else 1)
