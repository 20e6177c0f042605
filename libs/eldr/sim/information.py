"""What a live router knows, and when: the information delays of the live system.

The simulator's default gives every routing decision perfect, instant fleet state: the
exact number of requests on every worker and the exact set of requests whose experts are
in flight there. A live router replica (services/router) knows less:

- **Load reports.** A worker's running + waiting requests and KV tokens as of its last
  `LoadReport` (published every `report_interval_s`, reaching the routers `report_hop_s`
  later), plus the assignments the replica has seen since (pending until a report lists
  them as admitted). A request that finished after the report still counts until the
  next one.
- **Decisions.** A replica counts its own decision when it makes it, before the commit's
  acknowledgement (`RouterCore.reserve`; `commit_s` = 0; a positive `commit_s` models a
  router that counts only after the acknowledgement, as the live one did before issue 14:
  decisions taken meanwhile do not see it) and another replica's after `propagation_s`
  (stored by JetStream, pushed to the subscribers).
  Arrivals are split between `routers` replicas (the shared pull consumer hands each
  PrefillDone to one of them), each with its own policy state (round-robin cursor).
- **Finishes.** A finished request leaves a replica's pending set and activity table when
  the gateway's `RequestFinished` reaches it, `finish_lag_s` after its last token.
- **Dispatch.** The decision reaches the requester, whose job reaches the worker
  `dispatch_s` after the decision; TPOT is measured from there, as the worker measures it.

`InformationModel` holds these numbers; `eldr.sim.cluster.simulate(information=...)` runs
each replica on the live router's own state: a `RouterCore` with its `LoadTable` and
`ActivityTable` (`eldr.core.routing.decide`, `eldr.core.routing.loadtable`,
`eldr.core.routing.activity`), fed the same events through the router's own handling
(`eldr.roles.router.RouterEvents`: load reports, decisions, finishes, the periodic expiry)
at the simulated times they would reach it.

`LIVE_DEFAULTS` are the live settings and hop latencies measured on the local stack (each
number's source is in its field's docstring); `InformationModel.perfect()` with all delays
zero reproduces the perfect-information simulation (a unit test checks it decision for
decision).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from eldr.core.routing.activity import ExpertDemand
from eldr.core.routing.decide import RouterCore
from eldr.core.routing.loadtable import LoadTable, Report
from eldr.core.routing.pipeline import Policy
from eldr.core.routing.profile import RoundRobinProfile
from eldr.roles.router import RouterEvents

Split = Literal["random", "alternate"]
SPLITS: tuple[Split, ...] = ("random", "alternate")

SIMDECODE_REPORT_INTERVAL_S = 0.1
"""`ELDR_SIMDECODE_REPORT_INTERVAL_S` default (services/simdecode/settings.py)."""
DECODE_ADAPTER_REPORT_INTERVAL_S = 0.5
"""`ELDR_ADAPTER_INTERVAL_S` default (services/decodeadapter/settings.py): a vLLM decode
instance's load, scraped from its /metrics."""
DEMO_ROUTERS = 2
"""Router replicas of the local stack and the demo (`eldr.dev.stack.SERVICES`)."""
ROUTER_EXPIRE_PERIOD_S = 0.25
"""The router's expiry period (services/router/service.py `expire_period_s`, with the
default stale_after_s of 3 s)."""


@dataclass(frozen=True)
class InformationModel:
    """The live system's information delays (simulated seconds; see the module docstring)."""

    routers: int = DEMO_ROUTERS
    report_interval_s: float = SIMDECODE_REPORT_INTERVAL_S
    """0: every time a router looks it has a report from that instant (perfect load)."""
    report_hop_s: float = 0.0009
    """Load report publish -> routers: a core NATS publish between local processes.
    Measured by `eldr compare-live`'s probe (receive time - `LoadReport.ts_s`, median) on the
    development machine, 2026-12-01 after issue 14, machine otherwise quiet: 0.77-0.86 ms in
    the three passes on real traces, 0.88-0.90 ms on the synthetic workload
    (docs/BENCHMARKS.md section 4). Before issue 14, under load 1.3-3.3: 2.9-4.0 ms."""
    commit_s: float = 0.0
    """Decision built -> counted by its own replica: 0, the live router counts a decision
    when it makes it (`RouterCore.reserve`, services/router). Until issue 14 it counted it
    after the commit's JetStream acknowledgement, which this modelled as 3 ms (the
    decision's delivery time to the probe, receive time - `Decision.ts_s`)."""
    propagation_s: float = 0.0007
    """Decision built -> counted by the other replicas (stored, then pushed on
    `decisions.*`): the decision's delivery time to the probe, 0.58-0.68 ms (real traces),
    0.58-0.76 ms (synthetic), same runs (2.8-4.7 ms before issue 14)."""
    dispatch_s: float = 0.0024
    """Decision built -> its job at the worker (the commit, the reply to the requester's
    inbox, the requester's `DecodeJob` request): 2.25-2.37 ms (real traces), 2.36-2.78 ms
    (synthetic), same runs (9.2-18.9 ms before issue 14)."""
    finish_lag_s: float = 0.0015
    """Last token -> the finish event at the routers (the worker's `DecodeJobDone` to the
    gateway, then its `RequestFinished` to the routers): 1.40-1.51 ms (real traces),
    1.40-1.92 ms (synthetic), same runs (11.8-28.8 ms before issue 14)."""
    expire_period_s: float = ROUTER_EXPIRE_PERIOD_S
    stale_after_s: float = 3.0
    """`ELDR_STALE_AFTER_S` default."""
    pending_ttl_s: float = 10.0
    """`ELDR_PENDING_TTL_S` default."""
    activity_slack: int = 4
    """`ELDR_ACTIVITY_SLACK` default."""
    split: Split = "random"
    """How arrivals are split between replicas: at random (what the shared pull consumer
    does, as measured by the probe) or alternately."""
    shares: tuple[float, ...] | None = None
    """With a random split, each replica's share of the arrivals (None: equal). The shared
    pull consumer does not split evenly: `eldr compare-live` measured 87% / 13% of the
    decisions by one replica and the other (85% / 15% in another pass)."""

    def __post_init__(self) -> None:
        if self.routers < 1:
            raise ValueError(f"routers must be >= 1, got {self.routers}")
        for name in (
            "report_interval_s",
            "report_hop_s",
            "commit_s",
            "propagation_s",
            "dispatch_s",
            "finish_lag_s",
        ):
            value = getattr(self, name)
            if not (value >= 0 and np.isfinite(value)):
                raise ValueError(f"{name} must be a finite non-negative number, got {value}")
        if self.expire_period_s <= 0 or self.stale_after_s <= 0 or self.pending_ttl_s <= 0:
            raise ValueError("expire_period_s, stale_after_s and pending_ttl_s must be positive")
        if self.activity_slack < 0:
            raise ValueError(f"activity_slack must be >= 0, got {self.activity_slack}")
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        if self.shares is not None and (
            len(self.shares) != self.routers
            or min(self.shares) < 0
            or abs(sum(self.shares) - 1.0) > 1e-6
        ):
            raise ValueError(f"shares must be {self.routers} non-negative numbers summing to 1")

    @classmethod
    def perfect(cls, routers: int = 1) -> InformationModel:
        """No delay anywhere (the perfect-information simulation, through the router's
        own tables)."""
        return cls(
            routers=routers,
            report_interval_s=0.0,
            report_hop_s=0.0,
            commit_s=0.0,
            propagation_s=0.0,
            dispatch_s=0.0,
            finish_lag_s=0.0,
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


LIVE_DEFAULTS = InformationModel(shares=(0.87, 0.13))
"""The local stack's settings (simdecode's report interval, the demo's 2 routers), its hop
latencies and replica split as measured; `eldr bench` reports the baselines, the default
and the paper rule with these and without them."""
VLLM_DEFAULTS = InformationModel(report_interval_s=DECODE_ADAPTER_REPORT_INTERVAL_S)
"""The same with the decode adapter's report interval (real vLLM decode instances)."""


class RouterReplica:
    """One simulated router replica: the live router's state (`RouterCore` with its load
    and activity tables) plus its own instance of the policy.

    The `RouterCore`'s own policy is not used (the simulator builds the fleet view from the
    core's tables and asks `policy`); it only holds the tables, so its profile is a
    placeholder.
    """

    def __init__(self, index: int, policy: Policy, model: InformationModel) -> None:
        self.index = index
        self.policy = policy
        table = LoadTable(stale_after_s=model.stale_after_s, pending_ttl_s=model.pending_ttl_s)
        self.core = RouterCore(
            RoundRobinProfile(),
            table,
            np.random.default_rng(index),
            activity_slack=model.activity_slack,
        )
        self.events = RouterEvents(self.core)
        """What the live router does with each event (`eldr.roles.router`)."""
        self.decisions = 0

    @property
    def table(self) -> LoadTable:
        return self.core.table

    def on_report(self, report: Report, now_s: float) -> None:
        """A load report reached this replica."""
        self.events.on_report(report, now_s)

    def on_decision(
        self,
        worker_id: str,
        request_id: str,
        kv_tokens: int,
        demand: ExpertDemand | None,
        now_s: float,
    ) -> None:
        """A decision reached this replica (its own committed, or another's on the stream):
        pending on its worker, and its experts counted there. Another replica's decision
        carries no KV tokens (the live router counts them as 0)."""
        self.events.on_assignment(worker_id, request_id, kv_tokens, demand, now_s)

    def on_finished(self, request_id: str, now_s: float) -> None:
        self.events.on_finished(request_id, now_s)

    def expire(self, now_s: float) -> None:
        """One pass of the router's periodic expiry."""
        self.events.expire(now_s)


def make_replicas(policy: Policy, model: InformationModel) -> list[RouterReplica]:
    """One replica per router; with several, each gets its own copy of the policy (its own
    cursor), as each live replica builds its own."""
    if model.routers == 1:
        return [RouterReplica(0, policy, model)]
    return [RouterReplica(i, copy.deepcopy(policy), model) for i in range(model.routers)]


def split_arrivals(model: InformationModel, n_arrivals: int, seed: int) -> np.ndarray:
    """The replica that routes each arrival (int64 [n_arrivals])."""
    if model.routers == 1:
        return np.zeros(n_arrivals, dtype=np.int64)
    if model.split == "alternate":
        return np.arange(n_arrivals, dtype=np.int64) % model.routers
    rng = np.random.default_rng([seed, 4])
    if model.shares is not None:
        return rng.choice(model.routers, size=n_arrivals, p=list(model.shares)).astype(np.int64)
    return rng.integers(0, model.routers, size=n_arrivals).astype(np.int64)


def view_errors(
    view_in_flight: np.ndarray, true_in_flight: np.ndarray, activity_entries: int
) -> tuple[float, int]:
    """(mean |seen - true| in-flight requests per worker, activity entries - true in flight)
    at one decision: how stale the replica's load was, and how far its activity table lagged."""
    err = float(np.abs(view_in_flight - true_in_flight).mean()) if view_in_flight.size else 0.0
    return err, int(activity_entries - int(true_in_flight.sum()))


def describe(model: InformationModel | None) -> str:
    """One line for reports."""
    if model is None:
        return "perfect information"
    split: str = model.split
    if model.shares is not None:
        split += " " + "/".join(f"{100 * x:.0f}%" for x in model.shares)
    parts: Sequence[str] = (
        f"{model.routers} router(s), split {split}",
        (
            "perfect load reports"
            if model.report_interval_s == 0
            else f"load reports every {1e3 * model.report_interval_s:g} ms "
            f"(+{1e3 * model.report_hop_s:g} ms)"
        ),
        f"own decisions after {1e3 * model.commit_s:g} ms, others' after "
        f"{1e3 * model.propagation_s:g} ms",
        f"finishes after {1e3 * model.finish_lag_s:g} ms",
        f"jobs at the worker after {1e3 * model.dispatch_s:g} ms",
    )
    return "; ".join(parts)
