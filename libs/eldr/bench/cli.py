"""The benchmarks' command lines: `eldr bench`, `bench-kmeans`, `bench-decide`,
`bench-pipeline`, `bench-moe-step`.

The argparse wiring of every benchmark lives here; the benchmark modules hold what they
measure and import nothing from this one. `eldr bench --scenario drift|churn` dispatches to
the online scenarios (`eldr.bench.online_bench`) with the steady bench's arguments.

Each benchmark module is imported when its parser is built or its command runs, not when
this module is imported, so `python -m eldr.bench.cli bench-moe-step ...` (the GPU run)
needs only the MoE step bench's own imports.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eldr.bench import moe_step_bench

if TYPE_CHECKING:
    from eldr.bench.routing_bench import BenchConfig
    from eldr.core.routing.profile import ProfileBase
    from eldr.core.workload.trace import TraceSet
    from eldr.progress import Progress

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    """Add every benchmark command (what `eldr.cli` calls)."""
    _register_bench(subparsers)
    _register_kmeans(subparsers)
    _register_decide(subparsers)
    _register_pipeline(subparsers)
    _register_moe_step(subparsers)


# --- eldr bench ------------------------------------------------------------------------------


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _load_input(args: argparse.Namespace) -> TraceSet:
    if args.traces:
        from eldr.data.traces import load_trace_dir

        return load_trace_dir(args.traces, num_experts=args.num_experts)
    import numpy as np

    from eldr.core.workload.synthetic import generate
    from eldr.core.workload.synthetic_fit import FITTED_SPEC

    # The demo's workload: fitted to the real traces' statistics.
    return generate(FITTED_SPEC, args.synthetic_requests, np.random.default_rng(args.seed))


def _register_bench(subparsers: Any) -> None:
    from eldr.bench import routing_bench
    from eldr.bench.routing_bench import DECODE_SIGNATURE, DEFAULT_POLICY, PAPER_POLICY
    from eldr.core.routing.profile import LOAD_MEASURES, PAPER_PROFILE
    from eldr.data.deployments import DEFAULT_DEPLOYMENT_FOR_TRACES
    from eldr.sim.information import LIVE_DEFAULTS

    p = subparsers.add_parser(
        "bench",
        help="trace-driven routing benchmark (policies x rates on a simulated PD cluster)",
        description=routing_bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--traces", type=Path, help="trace directory (<label>/<n>.json); default: synthetic"
    )
    p.add_argument(
        "--num-experts", type=int, default=None, help="experts per MoE layer (default: from data)"
    )
    p.add_argument(
        "--synthetic-requests", type=int, default=400, help="requests to generate without --traces"
    )
    p.add_argument("--decoders", type=int, default=16, help="decode workers (default 16)")
    p.add_argument(
        "--tau",
        type=float,
        default=None,
        help="band width of every band policy run (default: the profile's, "
        f"{PAPER_PROFILE.band_tau:g}, the paper's)",
    )
    p.add_argument(
        "--policies",
        default=None,
        help="comma-separated policies to run (default: the four baselines, "
        f"{DEFAULT_POLICY} (default), {PAPER_POLICY} (the paper's rule), {DECODE_SIGNATURE} "
        "(the band rule fed the true decode signature))",
    )
    p.add_argument(
        "--variants",
        action="store_true",
        help="also run the variants (eldr_cost, eldr@kv_tokens, eldr_bounded, eldr_cost+partition)",
    )
    p.add_argument(
        "--add-profile",
        action="append",
        default=[],
        metavar="JSON",
        help='also run this routing profile, e.g. \'{"policy": "eldr_band_cost", "slack": 0.1}\' '
        "or a pipeline of stages (repeat; each row is labelled by what differs from its "
        "policy's defaults)",
    )
    p.add_argument(
        "--scenario",
        choices=("steady", "drift", "churn"),
        default="steady",
        help="steady: policies x rates (default); drift: the workload mix changes mid-run, "
        "static partition vs online refit; churn: decode workers join and leave mid-run",
    )
    p.add_argument(
        "--load-measure",
        choices=LOAD_MEASURES,
        default=None,
        help="load measure of every policy run that takes one (default: the profiles', "
        "in-flight requests)",
    )
    p.add_argument(
        "--deployment",
        default=DEFAULT_DEPLOYMENT_FOR_TRACES,
        help="deployment (see deployments.toml)",
    )
    p.add_argument("--whatif", default="", help="comma-separated extra deployments to report")
    p.add_argument(
        "--rates", type=_floats, default=None, help="comma-separated arrival rates (req/s)"
    )
    p.add_argument(
        "--batch-targets",
        type=_floats,
        default=None,
        help="derive rates for these per-worker batch sizes",
    )
    p.add_argument("--arrivals", type=int, default=None, help="arrivals per rate")
    p.add_argument(
        "--max-batch",
        type=int,
        default=256,
        help="max running requests per worker (vLLM max_num_seqs)",
    )
    p.add_argument("--calibration-fraction", type=float, default=0.4)
    p.add_argument(
        "--quick", action="store_true", help="batch targets 8, 16, 32 and 3,000 arrivals each"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--seeds",
        type=lambda text: tuple(int(x) for x in text.split(",") if x.strip()),
        default=None,
        help="comma-separated seeds: run the whole benchmark once per seed (split, "
        "partition, arrivals) and report the summaries side by side with the worst case",
    )
    p.add_argument(
        "--with-replacement",
        action="store_true",
        help="draw arrivals with replacement (copies of a request may decode side by side; "
        "the benchmark before issue 17), to compare",
    )
    p.add_argument(
        "--no-reference",
        "--no-offline-bound",
        dest="no_reference",
        action="store_true",
        help="skip the offline reference (a local search over assignments from several starts)",
    )
    p.add_argument(
        "--no-live-information",
        action="store_true",
        help="skip the runs with a live router's information (perfect information only)",
    )
    p.add_argument(
        "--report-interval",
        type=float,
        default=LIVE_DEFAULTS.report_interval_s,
        help="load-report period of the live-information runs, seconds (default "
        f"{LIVE_DEFAULTS.report_interval_s:g}: simdecode's; the vLLM decode adapter's is 0.5)",
    )
    p.add_argument(
        "--routers",
        type=int,
        default=LIVE_DEFAULTS.routers,
        help=f"router replicas of the live-information runs (default {LIVE_DEFAULTS.routers})",
    )
    p.add_argument("--json", type=Path, help="write the result as JSON here")
    p.add_argument("--plot", type=Path, help="write a PNG plot here (default: next to --json)")
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from eldr.bench.routing_bench import (
        FULL_BATCH_TARGETS,
        QUICK_BATCH_TARGETS,
        BenchConfig,
        bench_steps,
        format_table,
        plot,
        run_bench,
    )
    from eldr.progress import terminal_progress
    from eldr.sim.information import LIVE_DEFAULTS

    if args.scenario != "steady":
        return _run_online(args)
    for out in (args.json, args.plot):
        if out is not None:  # fail now, not after the run
            out.parent.mkdir(parents=True, exist_ok=True)
    traces = _load_input(args)
    targets = args.batch_targets or (QUICK_BATCH_TARGETS if args.quick else FULL_BATCH_TARGETS)
    config = BenchConfig(
        decoders=args.decoders,
        tau=args.tau,
        load_measure=args.load_measure,
        calibration_fraction=args.calibration_fraction,
        arrivals_per_rate=args.arrivals or (3000 if args.quick else 8000),
        max_batch=args.max_batch,
        batch_targets=tuple(targets),
        rates=args.rates,
        deployment=args.deployment,
        whatif_deployments=tuple(x for x in args.whatif.split(",") if x),
        seed=args.seed,
        policies=(
            tuple(x.strip() for x in args.policies.split(",") if x.strip())
            if args.policies
            else BenchConfig.policies
        ),
        variants=args.variants,
        extra_profiles=tuple(_decoded_profile(x) for x in args.add_profile),
        arrivals_apart=not args.with_replacement,
        reference=not args.no_reference,
        information=(
            None
            if args.no_live_information
            else replace(
                LIVE_DEFAULTS, report_interval_s=args.report_interval, routers=args.routers
            )
        ),
    )
    num_rates = len(config.rates) if config.rates else len(config.batch_targets)
    steps = bench_steps(config, num_rates) * (len(args.seeds) if args.seeds else 1)
    with terminal_progress(steps, "eldr bench", unit="run") as progress:
        if args.seeds:
            return _run_bench_seeds(traces, config, args.seeds, args.json, progress)
        result = run_bench(traces, config, progress)
    print(format_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    plot_path = args.plot or (args.json.with_suffix(".png") if args.json else None)
    if plot_path:
        plot(result, plot_path)
        print(f"plot: {plot_path}")
    return 0


def _run_bench_seeds(
    traces: TraceSet,
    config: BenchConfig,
    seeds: Sequence[int],
    json_path: Path | None,
    progress: Progress,
) -> int:
    from eldr.bench.routing_bench import format_summary, robustness, run_bench

    runs = []
    for seed in seeds:
        result = run_bench(traces, replace(config, seed=seed), progress)
        runs.append(result)
        s = result["summary"]
        print(f"seed {seed}:", flush=True)
        print("\n".join(format_summary(s)), flush=True)
    summary = robustness([r["summary"] for r in runs])
    print("worst case over seeds: " + json.dumps(summary))
    if json_path:
        json_path.write_text(json.dumps({"robustness": summary, "runs": runs}, indent=2))
    return 0


def _decoded_profile(text: str) -> ProfileBase:
    """A routing profile from its JSON (`--add-profile`); a clear error names the problem."""
    from eldr.core.routing.profile import decode_profile
    from eldr.errors import InputError

    try:
        return decode_profile(text)
    except ValueError as exc:
        raise InputError(f"--add-profile: {exc}") from None


def _run_online(args: argparse.Namespace) -> int:
    """`eldr bench --scenario drift|churn` (the steady bench's arguments apply)."""
    from eldr.bench.online_bench import OnlineConfig, format_report, run_churn, run_drift
    from eldr.core.routing.profile import DEFAULT_PROFILE, profile_from_params

    def with_tau(profile: ProfileBase, tau: float) -> ProfileBase:
        return profile_from_params(profile.name, {"tau": tau}, keep=profile)

    traces = _load_input(args)
    config = OnlineConfig(
        decoders=args.decoders,
        locality=DEFAULT_PROFILE if args.tau is None else with_tau(DEFAULT_PROFILE, args.tau),
        arrivals=args.arrivals or 6000,
        max_batch=args.max_batch,
        calibration_fraction=args.calibration_fraction,
        deployment=args.deployment,
        seed=args.seed,
        batch_target=(args.batch_targets[-1] if args.batch_targets else 32.0),
    )
    result = run_drift(traces, config) if args.scenario == "drift" else run_churn(traces, config)
    print(format_report(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


# --- eldr bench-kmeans -----------------------------------------------------------------------


def _register_kmeans(subparsers: Any) -> None:
    from eldr.bench import kmeans_bench

    parser = subparsers.add_parser(
        "bench-kmeans",
        help="time the balanced K-means partition fit on synthetic signatures",
        description=kmeans_bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--n", type=int, default=100_000, help="signatures (default 100000)")
    parser.add_argument("--dim", type=int, default=6144, help="signature length (default 6144)")
    parser.add_argument("--k", type=int, default=64, help="clusters = decode workers (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="data and fit seed (default 0)")
    parser.add_argument(
        "--reduce-dim",
        type=int,
        default=128,
        help="PCA dimension for the iterations, 0 = none (default 128)",
    )
    parser.add_argument("--max-iter", type=int, default=50, help="K-means iterations (default 50)")
    parser.add_argument(
        "--unconstrained",
        action="store_true",
        help="also fit unconstrained spherical K-means and report the inertia ratio",
    )
    parser.add_argument("--json", metavar="FILE", default=None, help="write the report as JSON")
    parser.set_defaults(func=_run_kmeans)


def _run_kmeans(args: argparse.Namespace) -> int:
    from eldr.bench.kmeans_bench import print_report, run_benchmark
    from eldr.progress import terminal_progress

    path = Path(args.json) if args.json is not None else None
    if path is not None:  # fail now, not after the fit
        path.parent.mkdir(parents=True, exist_ok=True)
    steps = 1 + args.max_iter * (2 if args.unconstrained else 1)
    with terminal_progress(steps, "eldr bench-kmeans", unit="step") as progress:
        report = run_benchmark(
            args.n,
            args.dim,
            args.k,
            seed=args.seed,
            reduce_dim=args.reduce_dim or None,
            unconstrained=args.unconstrained,
            max_iter=args.max_iter,
            progress=progress,
        )
    print_report(report)
    if path is not None:
        path.write_text(json.dumps(report, indent=2) + "\n")
        log.info("wrote %s", path)
    return 0


# --- eldr bench-decide -----------------------------------------------------------------------


def _register_decide(subparsers: Any) -> None:
    from eldr.bench import decide_bench
    from eldr.core.routing.profile import ROUTER_POLICIES

    p = subparsers.add_parser(
        "bench-decide",
        help="in-process decision time of RouterCore.decide per policy (microseconds)",
        description=decide_bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--traces", type=Path, help="trace directory (<label>/<n>.json); default: synthetic"
    )
    p.add_argument("--num-experts", type=int, default=None)
    p.add_argument(
        "--policies",
        default=",".join(decide_bench.DEFAULT_POLICIES),
        help=f"comma-separated policies (of {', '.join(ROUTER_POLICIES)})",
    )
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--in-flight", type=int, default=8, help="requests in flight per worker")
    p.add_argument("--decisions", type=int, default=5000, help="timed decisions per policy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.set_defaults(func=_run_decide)


def _run_decide(args: argparse.Namespace) -> int:
    from eldr.bench.decide_bench import DecideBenchConfig, format_table, run

    if args.traces:
        from eldr.data.traces import load_trace_dir

        traces = load_trace_dir(args.traces, num_experts=args.num_experts)
    else:
        from eldr.bench.pipeline_bench import synthetic_traffic

        traces = synthetic_traffic(args.seed)
    config = DecideBenchConfig(
        policies=tuple(x.strip() for x in args.policies.split(",") if x.strip()),
        workers=args.workers,
        in_flight=args.in_flight,
        decisions=args.decisions,
        seed=args.seed,
    )
    result = run(traces, config)
    print(format_table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


# --- eldr bench-pipeline ---------------------------------------------------------------------


def _register_pipeline(subparsers: Any) -> None:
    from eldr.bench import pipeline_bench
    from eldr.core.routing.profile import DEFAULT_PROFILE, ROUTER_POLICIES

    p = subparsers.add_parser(
        "bench-pipeline",
        help="prefill-done -> decision latency through NATS at fixed rates",
        description=pipeline_bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rates", type=_floats, default=(500.0, 1000.0, 2000.0))
    p.add_argument("--duration", type=float, default=10.0, help="seconds per rate")
    p.add_argument("--routers", type=int, default=1)
    p.add_argument("--signatures", type=int, default=1)
    p.add_argument("--decoders", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--policy",
        choices=ROUTER_POLICIES,
        default=DEFAULT_PROFILE.name,
        help=f"routing policy (default: the router's default, {DEFAULT_PROFILE.name})",
    )
    p.add_argument(
        "--compare",
        choices=[*ROUTER_POLICIES, "none"],
        default="jsq",
        help="run the same rates with this policy too, through the same pipeline, and report "
        "the ratio (default jsq; 'none' to skip)",
    )
    p.add_argument(
        "--saturation-rates",
        type=_floats,
        default=(),
        help="comma-separated rates stepped through with --policy until P99 passes "
        "--saturation-p99-ms or a request is lost (e.g. 1000,1500,2000,3000)",
    )
    p.add_argument("--saturation-p99-ms", type=float, default=50.0)
    p.add_argument(
        "--replicas",
        type=_int_list,
        default=(),
        help="comma-separated router replica counts to measure throughput with, a stack each "
        "(e.g. 1,2,4)",
    )
    p.add_argument(
        "--throughput-rate",
        type=float,
        default=2000.0,
        help="offered rate of the --replicas runs (events/s; default 2000, about what one "
        "replaying process offers on two cores)",
    )
    p.add_argument(
        "--rss-every", type=float, default=1.0, help="RSS sampling period, seconds (0 = off)"
    )
    p.add_argument(
        "--no-local-signatures",
        dest="local_signatures",
        action="store_false",
        help="the simulated prefill worker sends no whole signature: every prefix hit's "
        "blocks come from the signature service (as before PrefillDone v4)",
    )
    p.add_argument(
        "--local-summary-blocks",
        type=int,
        default=None,
        help="blocks the simulated prefill worker keeps its own summary of (LRU; a hit on an "
        "evicted one goes to the service); default: every block it computed",
    )
    p.add_argument("--json", type=Path)
    p.set_defaults(func=_run_pipeline)


def _run_pipeline(args: argparse.Namespace) -> int:
    from eldr.bench.pipeline_bench import PipelineConfig, format_table, run, total_seconds
    from eldr.progress import terminal_progress

    if args.json:  # fail now, not after the run
        args.json.parent.mkdir(parents=True, exist_ok=True)
    config = PipelineConfig(
        rates=args.rates,
        duration_s=args.duration,
        routers=args.routers,
        signatures=args.signatures,
        decoders=args.decoders,
        seed=args.seed,
        rss_every_s=args.rss_every,
        policy=args.policy,
        compare_policy=None if args.compare in ("", "none") else args.compare,
        saturation_rates=args.saturation_rates,
        saturation_p99_ms=args.saturation_p99_ms,
        replica_counts=args.replicas,
        throughput_rate=args.throughput_rate,
        local_signatures=args.local_signatures,
        local_summary_blocks=args.local_summary_blocks,
    )
    total_s = total_seconds(config)
    with terminal_progress(total_s, "eldr bench-pipeline", unit="s") as progress:
        progress.describe("starting the stack")
        result = run(config, progress)
    print(format_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


# --- eldr bench-moe-step ---------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _register_moe_step(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench-moe-step",
        help="measure an MoE layer's decode step on a GPU (torch) and fit the cost model",
        description=moe_step_bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_moe_step_arguments(parser)


def _add_moe_step_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="moe_step_command", metavar="STEP", required=True)
    m = sub.add_parser(
        "measure",
        help="time MoE layer decode steps with torch (GPU; --tiny for a CPU smoke run)",
        description="Time one MoE layer forward per (deployment, batch, distinct experts).",
    )
    m.add_argument(
        "--deployments",
        default=",".join(s.profile for s in moe_step_bench.SHAPES),
        help="comma-separated deployments to measure (default: all with a MoE shape)",
    )
    m.add_argument(
        "--batches",
        type=_int_list,
        default=moe_step_bench.DEFAULT_BATCHES,
        help="comma-separated batch sizes in tokens (default 1,2,4,8,16,32,64)",
    )
    m.add_argument(
        "--points", type=int, default=6, help="distinct-expert counts per batch (default 6)"
    )
    m.add_argument("--reps", type=int, default=100, help="timed repetitions (default 100)")
    m.add_argument("--warmup", type=int, default=10, help="untimed repetitions (default 10)")
    m.add_argument(
        "--kernels",
        default="",
        help="comma-separated: triton (grouped GEMM), loop (one matmul per expert); "
        "default triton on a GPU, loop on the CPU",
    )
    m.add_argument("--device", default="", help="torch device (default cuda when available)")
    m.add_argument(
        "--flush-mib",
        type=int,
        default=-1,
        help="L2 flush buffer written before each repetition, MiB (default 256 on a GPU, 0 on CPU)",
    )
    m.add_argument("--no-graph", action="store_true", help="do not replay through CUDA graphs")
    m.add_argument("--no-check", action="store_true", help="skip the check against the loop")
    m.add_argument(
        "--tiny",
        action="store_true",
        help="tiny shapes (hidden 64, 16 experts) and batches 1,2,4: a CPU smoke run",
    )
    m.add_argument("--seed", type=int, default=0, help="routing and weight seed (default 0)")
    m.add_argument(
        "--out", default="out/moe_step.json", help="raw table, JSON (default out/moe_step.json)"
    )
    m.set_defaults(func=_run_moe_measure)

    f = sub.add_parser(
        "fit",
        help="fit a + b x distinct experts (+ c x tokens); optionally write measured deployments",
        description="Fit a measured table and compare with the bandwidth model.",
    )
    f.add_argument("table", help="a table written by `measure`")
    f.add_argument("--kernel", default="", help="kernel rows to fit (default triton if present)")
    f.add_argument("--json", metavar="FILE", default=None, help="write the fit report as JSON")
    f.add_argument(
        "--write-deployments",
        nargs="?",
        const="",
        default=None,
        metavar="FILE",
        help="write <deployment>-measured and <deployment>-measured-kernels deployments "
        "(default file: the packaged measured_deployments.toml)",
    )
    f.add_argument(
        "--table-ref",
        default="",
        help="path of the table recorded in the deployments' provenance (default: TABLE as given)",
    )
    f.add_argument(
        "--allow-gpu-mismatch",
        action="store_true",
        help="write deployments even if the device is not the deployment's GPU (tests only)",
    )
    f.set_defaults(func=_run_moe_fit)


def _run_moe_measure(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        print(
            "bench-moe-step measure needs torch (not a dependency of this project): run it "
            "where torch is installed, e.g. .venv-vllm or the GPU machine's Python",
            file=sys.stderr,
        )
        return 2
    from eldr.bench import moe_step_torch

    names = [x for x in args.deployments.split(",") if x]
    shapes = [moe_step_bench.shape_for(n) for n in names]
    batches: tuple[int, ...] = tuple(args.batches)
    if args.tiny:
        shapes = [moe_step_bench.tiny_shape(s) for s in shapes]
        batches = tuple(b for b in batches if b <= 4) or (1, 2, 4)
    config = moe_step_torch.MeasureConfig(
        shapes=tuple(shapes),
        batches=batches,
        points=args.points,
        reps=args.reps,
        warmup=args.warmup,
        kernels=tuple(x for x in args.kernels.split(",") if x),
        device=args.device,
        flush_mib=args.flush_mib,
        graph=not args.no_graph,
        check=not args.no_check,
        seed=args.seed,
        command=invocation(),
    )
    out = Path(args.out)

    def checkpoint(partial: dict[str, Any]) -> None:
        moe_step_bench.write_table(out, partial)
        print(f"{partial['shapes'][-1]['profile']}: done ({len(partial['rows'])} rows)", flush=True)

    table = moe_step_torch.measure(config, checkpoint)
    moe_step_bench.write_table(out, table)
    prov = table["provenance"]
    print(
        f"{len(table['rows'])} rows on {prov['gpu']} ({prov['device_type']}) in "
        f"{prov['wall_s']:.1f} s -> {out}"
    )
    for check in table["checks"]:
        print(f"check {check['profile']}: {check['status']} (max rel err {check['max_rel_err']})")
    return 0 if all(c["status"] != "failed" for c in table["checks"]) else 1


def _run_moe_fit(args: argparse.Namespace) -> int:
    table = moe_step_bench.read_table(Path(args.table))
    reports = moe_step_bench.fit_table(table, args.kernel or None)
    print(moe_step_bench.format_fits(reports, table["provenance"]))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"provenance": table["provenance"], "fits": [r.as_dict() for r in reports]},
                indent=1,
            )
            + "\n",
            encoding="utf-8",
        )
    if args.write_deployments is not None:
        path = (
            Path(args.write_deployments)
            if args.write_deployments
            else moe_step_bench.packaged_measured_path()
        )
        deployments = moe_step_bench.measured_deployment_tables(
            reports,
            table["provenance"],
            table_ref=args.table_ref or args.table,
            fit_command=invocation(),
            allow_gpu_mismatch=args.allow_gpu_mismatch,
        )
        written = moe_step_bench.write_measured_deployments(path, deployments)
        print(f"wrote {', '.join(written)} -> {path}")
    return 0


def invocation() -> str:
    """The command line this process runs, as a person would type it."""
    import shlex

    if not sys.argv:
        return ""
    head = Path(sys.argv[0]).name
    prefix = {"cli.py": "python -m eldr.bench.cli"}.get(head, head)
    return " ".join([prefix, shlex.join(sys.argv[1:])])


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m eldr.bench.cli bench-moe-step measure|fit ...`: the MoE step bench alone,
    without the `eldr` CLI's (and the other benchmarks') imports, for a GPU machine's Python."""
    parser = argparse.ArgumentParser(prog="python -m eldr.bench.cli")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _register_moe_step(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
