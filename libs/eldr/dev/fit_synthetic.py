"""`eldr fit-synthetic`: fit the demo's synthetic workload to real expert traces.

Measures the traces (`eldr.core.workload.synthetic_fit.workload_statistics`), fits the synthetic
generator's parameters to them (`fit_synthetic_spec`) and prints the statistics of both
side by side, with the fitted spec as the Python literal that
`eldr.core.workload.synthetic_fit.FITTED_SPEC` holds (paste it there, with this command and its
output in the docstring, when the traces change). Takes a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from eldr.core.workload.synthetic import generate
from eldr.core.workload.synthetic_fit import (
    FITTED,
    FITTED_SPEC,
    WorkloadStatistics,
    fit_synthetic_spec,
    workload_statistics,
)
from eldr.progress import terminal_progress

DEFAULT_TRACES = Path("../shared/data/pbc-llama4-mmlu")


def format_fit(target: WorkloadStatistics, achieved: WorkloadStatistics) -> list[str]:
    lines = [f"{'statistic':<32} {'traces':>10} {'synthetic':>10}"]
    for f in fields(WorkloadStatistics):
        a, b = getattr(target, f.name), getattr(achieved, f.name)
        mark = " (fitted)" if f.name in FITTED else ""
        lines.append(f"{f.name:<32} {a:>10.4g} {b:>10.4g}{mark}")
    return lines


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "fit-synthetic",
        help="fit the synthetic workload's parameters to real traces",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--traces", type=Path, default=DEFAULT_TRACES, help=f"default {DEFAULT_TRACES}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-evaluations", type=int, default=120, help="candidate workloads at most")
    p.add_argument(
        "--check",
        action="store_true",
        help="only measure the traces and the checked-in FITTED_SPEC side by side",
    )
    p.add_argument("--json", type=Path, help="write targets, fit and trail as JSON here")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from eldr.data.traces import load_trace_dir

    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    traces = load_trace_dir(args.traces)
    started = time.perf_counter()
    if args.check:
        import numpy as np

        target = workload_statistics(traces)
        achieved = workload_statistics(
            generate(FITTED_SPEC, len(traces), np.random.default_rng(args.seed))
        )
        print(f"input: {traces.source}, {len(traces)} requests; FITTED_SPEC as checked in")
        print("\n".join(format_fit(target, achieved)))
        return 0
    with terminal_progress(args.max_evaluations, "eldr fit-synthetic", unit="fit") as progress:
        fit = fit_synthetic_spec(
            traces,
            seed=args.seed,
            max_evaluations=args.max_evaluations,
            on_evaluation=lambda _: progress.advance(),
        )
    print(f"input: {traces.source}, {len(traces)} requests")
    print("\n".join(format_fit(fit.target, fit.achieved)))
    print(
        f"{fit.evaluations} candidate workloads of {len(traces)} requests each, seed {args.seed}, "
        f"{time.perf_counter() - started:.0f} s"
    )
    print("FITTED_SPEC = SyntheticSpec(")
    for name, value in asdict(fit.spec).items():
        print(f"    {name}={value!r},")
    print(")")
    if args.json:
        out = fit.as_dict()
        out["trail"] = fit.trail
        out["command"] = f"eldr fit-synthetic --traces {args.traces} --seed {args.seed}"
        args.json.write_text(json.dumps(out, indent=2))
        print(f"result: {args.json}")
    return 0
