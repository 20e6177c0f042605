"""The fault suite's stack: a throwaway PostgreSQL, an embedded nats-server and every
service as a real process, shared by the scenarios of a module (they run in order).

Besides `eldr dev up`'s services (1 signature replica, the trainer, a simdecode process with
4 workers, 2 routers) a second simdecode process hosts one more worker, `lonely-0`, so a
scenario can silence one decode worker without touching the others.

Knobs (environment): `ELDR_FAULTS_RATE` (requests/s of the steady load, default 100),
`ELDR_FAULTS_HOLD_S` (how long a held fault lasts, default 3), `ELDR_FAULTS_REPORT` (write
the results there as JSON, plus a Markdown table next to it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from eldr.core.workload.synthetic import SyntheticSpec, SyntheticWorld, generate, make_world
from eldr.core.workload.trace import TraceSet
from eldr.dev.natsserver import free_port
from eldr.dev.stack import SERVICES, ServiceSpec, Stack, StackConfig, serve_command
from support.prereq import missing

from .harness import ScenarioResult, markdown_table, write_report
from .pgserver import ThrowawayPostgres, missing_reason

ROUTERS = 2
DECODERS = 4
LONELY = "lonely-0"
STALE_AFTER_S = 1.5
ACK_WAIT_S = 4.0

SERVICE_ENV = {
    "OPENBLAS_NUM_THREADS": "1",
    # Fault timings: a killed router's events come back after ACK_WAIT_S; a silent decode
    # worker leaves the load table after STALE_AFTER_S.
    "ELDR_ROUTER_ACK_WAIT_S": str(ACK_WAIT_S),
    "ELDR_STALE_AFTER_S": str(STALE_AFTER_S),
    "ELDR_PENDING_TTL_S": "3",
    # A trainer that refits often on a small window (PostgreSQL writes during the run).
    "ELDR_REFIT_INTERVAL_S": "4",
    "ELDR_MIN_SAMPLES": "64",
    "ELDR_WINDOW_MAX_SAMPLES": "3000",
    "ELDR_WORKER_TTL_S": "5",
    "ELDR_REDUCE_DIM": "32",
    # Small streams: JetStream reserves max_bytes in the store.
    **{
        f"ELDR_{name}_MAX_BYTES": str(64 << 20)
        for name in ("BLOCKS", "PREFILL", "DECISIONS", "LOAD", "PROFILES", "DLQ")
    },
    "ELDR_PARTITIONS_MAX_BYTES": str(64 << 20),
}


def rate_per_s() -> float:
    return float(os.environ.get("ELDR_FAULTS_RATE", "100"))


def hold_s() -> float:
    return float(os.environ.get("ELDR_FAULTS_HOLD_S", "3"))


@dataclass
class FaultEnv:
    stack: Stack
    pg: ThrowawayPostgres
    lonely: subprocess.Popen[bytes]
    spec: SyntheticSpec
    world: SyntheticWorld
    log_dir: Path
    results: list[ScenarioResult] = field(default_factory=list)
    _scenarios: int = 0

    def fresh_traces(self) -> TraceSet:
        """New prompts from the same synthetic world: new block hashes, so each scenario
        publishes blocks (the signature replica must keep following BLOCKS)."""
        self._scenarios += 1
        return generate(
            self.spec,
            400,
            np.random.default_rng(self._scenarios),
            world=self.world,
            id_prefix=f"faults{self._scenarios}",
        )

    def pause(self, instance_id: str) -> None:
        os.kill(self.pid(instance_id), signal.SIGSTOP)

    def resume(self, instance_id: str) -> None:
        os.kill(self.pid(instance_id), signal.SIGCONT)

    def pid(self, instance_id: str) -> int:
        if instance_id == LONELY:
            return self.lonely.pid
        return self.stack.process(instance_id).pid

    def url(self, instance_id: str) -> str:
        return self.stack.process(instance_id).url

    def assert_running(self) -> None:
        dead = [p.instance_id for p in self.stack.processes if p.returncode is not None]
        if self.lonely.poll() is not None:
            dead.append(LONELY)
        assert not dead, f"service processes exited: {dead} (logs in {self.log_dir})"


def _spawn_lonely(stack: Stack, log_dir: Path) -> subprocess.Popen[bytes]:
    spec = next(s for s in SERVICES if s.name == "simdecode")
    env = {
        **os.environ,
        **stack.service_env(spec, 1, free_port()),
        "ELDR_SIMDECODE_WORKERS": LONELY,
        "ELDR_INSTANCE_ID": "simdecode-lonely",
    }
    out = (log_dir / "simdecode-lonely.log").open("ab")
    return subprocess.Popen(
        serve_command("simdecode"),
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


@pytest.fixture(scope="module")
def fault_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultEnv]:
    reason = missing_reason()
    if reason is not None:
        missing(
            "ELDR_TEST_REQUIRE_INITDB", f"the fault suite needs a throwaway PostgreSQL: {reason}"
        )
    root = tmp_path_factory.mktemp("faults")
    log_dir = root / "logs"
    pg = ThrowawayPostgres()
    pg.init()
    pg.start()
    services = tuple(
        s if s.name != "router" else ServiceSpec(s.name, ROUTERS, s.after, s.uses_database)
        for s in SERVICES
    )
    stack = Stack(
        StackConfig(
            namespace=f"f{uuid.uuid4().hex[:10]}",
            database_url=pg.url(),
            state_dir=root,
            decoders=DECODERS,
            replicas={"signature": 1, "router": ROUTERS},
            services=services,
            env=SERVICE_ENV,
            log_level="INFO",
            echo=False,
            log_dir=log_dir,
            ready_timeout_s=90,
        )
    )
    lonely: subprocess.Popen[bytes] | None = None
    try:
        stack.start()
        lonely = _spawn_lonely(stack, log_dir)
        spec = SyntheticSpec(num_topics=6, num_moe_layers=8, num_experts=32, top_k=2)
        world = make_world(spec, np.random.default_rng(0))
        env = FaultEnv(stack=stack, pg=pg, lonely=lonely, spec=spec, world=world, log_dir=log_dir)
        yield env
        table = markdown_table(env.results)
        print(f"\nfault scenarios ({rate_per_s():g} requests/s):\n{table}")
        report = os.environ.get("ELDR_FAULTS_REPORT")
        if report:
            write_report(
                Path(report),
                env.results,
                {
                    "rate_per_s": rate_per_s(),
                    "hold_s": hold_s(),
                    "routers": ROUTERS,
                    "decoders": DECODERS + 1,
                    "stale_after_s": STALE_AFTER_S,
                    "router_ack_wait_s": ACK_WAIT_S,
                    "written": time.strftime("%Y-%m-%d %H:%M:%S"),
                },
            )
    finally:
        if lonely is not None:
            os.kill(lonely.pid, signal.SIGCONT)
            lonely.terminate()
            try:
                lonely.wait(timeout=15)
            except subprocess.TimeoutExpired:
                lonely.kill()
                lonely.wait()
        for process in stack.processes:
            if process.returncode is None:
                os.kill(process.pid, signal.SIGCONT)
        stack.stop()
        pg.destroy()
