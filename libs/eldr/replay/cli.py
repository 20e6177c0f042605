"""`eldr export`, `eldr import`, `eldr replay`, `eldr explain`: debug routing from its records.

    eldr export FILE [RANGE]                   a window of recorded events -> a file
    eldr import FILE [--check]                 a file -> this namespace (or just validate it)
    eldr replay [--file FILE | RANGE] [WHAT-IF] re-run the window's decisions offline
    eldr explain REQUEST_ID [--file FILE]      one decision in plain words

RANGE selects decisions on the DECISIONS stream: `--last N` (default 10000), `--start-seq` /
`--end-seq`, `--since` / `--until` (Unix seconds, ISO 8601, or an age such as 15m, 2h);
the load reports, decode summaries, partition announcements and blobs around them come
along. WHAT-IF: `--policy`, `--tau`, `--load-measure`, `--param NAME=VALUE`,
`--partition VERSION|FILE`. NATS settings come from the environment (`ELDR_NATS_URL`,
`ELDR_NAMESPACE`, ...). See docs/REPLAY.md for a whole debugging session.

`eldr export` only reads: it publishes nothing (no dead letters either). Stored records
that do not decode are left out of the file, and it says how many and where the first one
is, on stderr and as a note in the file.

Exit status: 0 on success; 1 on an error (unreachable NATS, a damaged file, an unknown
request id); 3 when `eldr replay` could not reproduce every recorded decision; 4 when
`eldr export` wrote its file but left undecodable records out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eldr.bus import Bus
    from eldr.core.partition.partition import Partition
    from eldr.replay.engine import ReplayReport
    from eldr.replay.eventlog import EventLog, Selection
    from eldr.replay.source import UndecodableRecords

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_NOT_REPRODUCED = 3
EXIT_INCOMPLETE = 4
DEFAULT_LAST = 10_000

_AGE = re.compile(r"^-?\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)(?:\s+ago)?$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_time(text: str, now_s: float | None = None) -> float:
    """Unix seconds from "1714563600.5", "2026-05-01T12:00:00Z" or an age ("15m", "2h ago")."""
    value = text.strip()
    age = _AGE.match(value)
    if age:
        now = time.time() if now_s is None else now_s
        return now - float(age.group(1)) * _UNIT_S[age.group(2)]
    try:
        return float(value)
    except ValueError:
        pass
    try:
        parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"not a time: {text!r} (Unix seconds, ISO 8601 or an age such as 15m)"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.UTC)
    return parsed.timestamp()


def _time_arg(text: str) -> float:
    try:
        return parse_time(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _param(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=NUMBER, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


# --- argument groups ------------------------------------------------------------------------


def _add_range(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("range (decisions on the DECISIONS stream)")
    g.add_argument(
        "--last",
        type=_positive_int,
        default=None,
        help=f"the newest N decisions (default {DEFAULT_LAST} when no other range is given)",
    )
    g.add_argument("--start-seq", type=_positive_int, help="first stream sequence (inclusive)")
    g.add_argument("--end-seq", type=_positive_int, help="last stream sequence (inclusive)")
    g.add_argument("--since", type=_time_arg, help="stored at or after (Unix s, ISO, or 15m)")
    g.add_argument("--until", type=_time_arg, help="stored at or before")
    g.add_argument("--no-load-reports", action="store_true", help="leave out LOAD (it is the bulk)")
    g.add_argument(
        "--summary-lag",
        type=float,
        default=900.0,
        help="seconds after the last decision to look for decode summaries (default 900)",
    )
    g.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for NATS (default 300)"
    )


def _selection(args: argparse.Namespace) -> Selection:
    from eldr.replay.eventlog import Selection

    last = args.last
    if last is None and all(
        getattr(args, k) is None for k in ("start_seq", "end_seq", "since", "until")
    ):
        last = DEFAULT_LAST
    return Selection(
        since_s=args.since,
        until_s=args.until,
        start_seq=args.start_seq,
        end_seq=args.end_seq,
        last=last,
    )


def register(subparsers: Any) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = subparsers.add_parser(
        "export",
        help="write a window of recorded routing events to a file",
        description=__doc__,
        formatter_class=fmt,
    )
    p.add_argument("file", type=Path, help="output file (.gz: gzip-compressed)")
    _add_range(p)
    p.set_defaults(func=_cmd_export)

    p = subparsers.add_parser(
        "import",
        help="load an exported event file into this namespace (or --check it)",
        description=__doc__,
        formatter_class=fmt,
    )
    p.add_argument("file", type=Path)
    p.add_argument("--check", action="store_true", help="only validate the file (no NATS)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.set_defaults(func=_cmd_import)

    p = subparsers.add_parser(
        "replay",
        help="re-run recorded routing decisions offline, as recorded or what-if",
        description=__doc__,
        formatter_class=fmt,
    )
    p.add_argument("--file", type=Path, help="an exported file instead of NATS")
    _add_range(p)
    w = p.add_argument_group("what-if (default: as recorded)")
    w.add_argument("--policy", help="a policy name (eldr, eldr_bounded, eldr_cost, jsq, ...)")
    w.add_argument("--tau", type=float, help="locality band width (of the band policies)")
    w.add_argument(
        "--load-measure",
        choices=("requests", "kv_tokens"),
        help="the load measure (of every policy that takes one)",
    )
    w.add_argument(
        "--param",
        type=_param,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a profile parameter, repeatable (e.g. slack=0.2, locality_weight=0.5), set on "
        "every decision whose policy takes it",
    )
    w.add_argument(
        "--partition",
        help="a partition VERSION (from the file or the namespace) or a PartitionBlob file",
    )
    w.add_argument("--index-method", choices=("auto", "exact", "hnsw"), default="auto")
    m = p.add_argument_group("modelled decode effect")
    m.add_argument(
        "--deployment",
        default=None,
        help="deployment name (libs/eldr/data/deployments.toml; default: the Llama-4 one)",
    )
    m.add_argument("--deployments", type=Path, default=None, help="a deployments TOML file")
    m.add_argument("--sample-s", type=float, default=None, help="batch sampling step")
    m.add_argument(
        "--default-duration",
        type=float,
        default=None,
        help="in-flight seconds of a request without a decode summary (default: the median)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--json", dest="json_out", help="write the report as JSON here ('-': stdout)")
    o.add_argument("--png", type=Path, help="write a figure here")
    o.add_argument("--list", type=int, default=10, help="changed/mismatched decisions to list")
    p.set_defaults(func=_cmd_replay)

    p = subparsers.add_parser(
        "explain",
        help="explain one routing decision in plain words",
        description=__doc__,
        formatter_class=fmt,
    )
    p.add_argument("request_id")
    p.add_argument("--file", type=Path, help="an exported file instead of NATS")
    p.add_argument("--json", action="store_true", help="print the facts as JSON")
    p.add_argument("--timeout", type=float, default=10.0)
    p.set_defaults(func=_cmd_explain)


# --- shared plumbing ------------------------------------------------------------------------


def _fail(command: str, message: str) -> int:
    print(f"eldr {command}: {message}", file=sys.stderr)
    return EXIT_ERROR


async def _connect(command: str) -> Bus:
    from eldr.bus import Bus
    from eldr.settings import BusSettings

    settings = BusSettings()
    return await Bus.connect(settings, f"eldr-{command}")


def _load_file(command: str, path: Path) -> EventLog | str:
    """The log in `path`, or the error message."""
    from eldr.replay.eventlog import EventFileError, read_event_file

    try:
        return read_event_file(path)
    except EventFileError as exc:
        return str(exc)
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"


async def _read_from_nats(
    command: str, args: argparse.Namespace, undecodable: UndecodableRecords | None = None
) -> EventLog:
    from eldr.replay.source import read_events

    bus = await _connect(command)
    try:
        return await read_events(
            bus,
            _selection(args),
            load_reports=not args.no_load_reports,
            summary_lag_s=args.summary_lag,
            timeout_s=args.timeout,
            undecodable=undecodable,
        )
    finally:
        await bus.drain()


def _run_nats(command: str, coro: Any) -> Any:
    """Run `coro`; NATS failures become one line on stderr (returns None then)."""
    from eldr.bus import BusError
    from eldr.replay.source import SourceError
    from eldr.runtime import run_async
    from eldr.settings import BusSettings
    from eldr.wire import WireError

    try:
        return run_async(coro)
    except (BusError, TimeoutError) as exc:
        _fail(command, f"cannot use NATS at {BusSettings().nats_url}: {exc}")
    except (SourceError, WireError, ValueError) as exc:
        _fail(command, str(exc))
    return None


# --- export / import ----------------------------------------------------------------------


def _counts_line(counts: dict[str, int]) -> str:
    return ", ".join(f"{n:,} {k.replace('_', ' ')}" for k, n in counts.items())


def _report_undecodable(undecodable: UndecodableRecords) -> None:
    if not undecodable.total:
        return
    print(
        f"eldr export: {undecodable.total:,} stored record(s) could not be decoded and are "
        "not in the file (nothing was dead-lettered):",
        file=sys.stderr,
    )
    for line in undecodable.lines():
        print(f"  {line}", file=sys.stderr)


def _cmd_export(args: argparse.Namespace) -> int:
    from eldr.replay.eventlog import write_event_file
    from eldr.replay.source import UndecodableRecords

    undecodable = UndecodableRecords()
    event_log = _run_nats("export", _read_from_nats("export", args, undecodable))
    if event_log is None:
        return EXIT_ERROR
    _report_undecodable(undecodable)
    if not event_log.decisions:
        return _fail(
            "export",
            f"no decisions recorded in namespace {event_log.namespace} for "
            f"{event_log.selection.describe()}: nothing written",
        )
    size = write_event_file(event_log, args.file)
    on_disk = Path(args.file).stat().st_size
    sizes = f"{on_disk:,} bytes" + (f", {size:,} uncompressed" if on_disk != size else "")
    print(
        f"wrote {args.file} ({sizes}): namespace {event_log.namespace}, "
        f"{event_log.selection.describe()}"
    )
    print(f"  {_counts_line(event_log.counts())}")
    for note in event_log.notes:
        print(f"  note: {note}")
    return EXIT_INCOMPLETE if undecodable.total else EXIT_OK


def _cmd_import(args: argparse.Namespace) -> int:
    loaded = _load_file("import", args.file)
    if isinstance(loaded, str):
        return _fail("import", loaded)
    print(
        f"{args.file}: valid event log of namespace {loaded.namespace} "
        f"({loaded.selection.describe()}): {_counts_line(loaded.counts())}"
    )
    if args.check:
        return EXIT_OK
    summary = _run_nats("import", _import(loaded))
    if summary is None:
        return EXIT_ERROR
    print(f"imported into namespace {summary[0]}: {summary[1].blobs} partition blobs")
    for stream, n in summary[1].published.items():
        present = summary[1].already_present.get(stream, 0)
        extra = f" ({present:,} already there)" if present else ""
        print(f"  {stream}: {n:,} published{extra}")
    return EXIT_OK


async def _import(event_log: EventLog) -> tuple[str, Any]:
    from eldr.replay.source import import_events

    bus = await _connect("import")
    try:
        return bus.subjects.namespace, await import_events(bus, event_log)
    finally:
        await bus.drain()


# --- replay ---------------------------------------------------------------------------------


async def _nats_partition(version: int, timeout_s: float) -> Any:
    from eldr.replay.source import fetch_partition_version

    bus = await _connect("replay")
    try:
        return await fetch_partition_version(bus, version, timeout_s)
    finally:
        await bus.drain()


def _partition_arg(args: argparse.Namespace, event_log: EventLog) -> Partition | str | None:
    """The --partition override (None when not given), or an error message."""
    from eldr.partitions.codec import partition_from_blob
    from eldr.wire import PartitionBlob, WireError, decode

    if args.partition is None:
        return None
    text = str(args.partition)
    if text.isdigit():
        version = int(text)
        blob = event_log.partition_blob(version)
        if blob is None and args.file is None:
            blob = _run_nats("replay", _nats_partition(version, args.timeout))
        if blob is None:
            where = args.file or f"namespace {event_log.namespace}"
            return f"partition version {version} is not in {where}"
    else:
        try:
            blob = decode(Path(text).read_bytes(), PartitionBlob, 1 << 30)
        except OSError as exc:
            return f"cannot read partition file {text}: {exc.strerror or exc}"
        except WireError as exc:
            return f"{text} is not a partition blob: {exc}"
    try:
        return partition_from_blob(blob, args.index_method)
    except ValueError as exc:
        return f"partition version {blob.version} is unusable: {exc}"


def _cmd_replay(args: argparse.Namespace) -> int:
    from eldr.data.deployments import DEFAULT_DEPLOYMENT_FOR_TRACES, DeploymentError, load_catalog
    from eldr.progress import terminal_progress
    from eldr.replay.engine import replay, replay_steps
    from eldr.replay.whatif import ReplayConfig

    if args.file is not None:
        loaded = _load_file("replay", args.file)
        if isinstance(loaded, str):
            return _fail("replay", loaded)
        event_log = loaded
    else:
        fetched = _run_nats("replay", _read_from_nats("replay", args))
        if fetched is None:
            return EXIT_ERROR
        event_log = fetched
    if not event_log.decisions:
        return _fail("replay", f"no decisions in {event_log.source or 'the selection'}")
    partition = _partition_arg(args, event_log)
    if isinstance(partition, str):
        return _fail("replay", partition)
    try:
        cost = load_catalog(args.deployments).get(args.deployment or DEFAULT_DEPLOYMENT_FOR_TRACES)
        named = (("tau", args.tau), ("load_measure", args.load_measure))
        params = [(k, v) for k, v in named if v is not None] + sorted(dict(args.param).items())
        config = ReplayConfig(
            policy=args.policy,
            params=tuple(params),
            partition=partition,
            index_method=args.index_method,
            cost=cost,
            sample_s=args.sample_s,
            default_duration_s=args.default_duration,
            max_listed=max(args.list, 0),
        )
    except (DeploymentError, ValueError, OSError) as exc:
        return _fail("replay", str(exc))
    steps = replay_steps(event_log, config)
    with terminal_progress(steps, "eldr replay", unit="decision") as progress:
        report = replay(event_log, config, progress)
    if args.json_out == "-":
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(format_report(report, args.list))
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(report.as_dict(), indent=2))
    if args.png:
        plot_report(report, args.png)
    return EXIT_OK if report.reproduction.complete else EXIT_NOT_REPRODUCED


def _pct(before: float | None, after: float | None) -> str:
    if before is None or after is None or before == 0:
        return ""
    return f" ({100.0 * (after / before - 1.0):+.1f}%)"


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_report(report: ReplayReport, listed: int = 10) -> str:
    from eldr.replay.eventlog import format_ts

    lines = []
    span = ""
    if report.first_ts_s is not None and report.last_ts_s is not None:
        span = (
            f", {format_ts(report.first_ts_s)} to {format_ts(report.last_ts_s)} "
            f"({report.last_ts_s - report.first_ts_s:.1f} s)"
        )
    source = report.source or f"namespace {report.namespace}"
    lines.append(f"{report.decisions:,} decisions from {source}{span}")
    if report.expired:
        lines.append(
            f"{report.expired:,} expired records (taken after their deadline, no worker "
            "assigned): not replayed"
        )
    recorded = "; ".join(f"{k}: {n:,}" for k, n in report.recorded_policies.items())
    lines.append(f"recorded policies: {recorded}")
    r = report.reproduction
    if r.checked:
        lines.append(
            f"reproduction with the recorded configuration: {r.reproduced:,} of {r.checked:,} "
            f"decisions reproduced ({100.0 * r.share:.2f}%); "
            f"{r.needed_draw:,} depended on their recorded tie-break/random draw"
        )
    else:
        lines.append(
            f"reproduction with the recorded configuration: none of the {r.decisions:,} "
            "decisions could be checked on its recorded inputs alone (see below)"
        )
    extra = []
    if r.anchored:
        extra.append(f"{r.anchored} round-robin decisions anchored the replica cursors")
    if r.unreplayable:
        extra.append(f"{r.unreplayable} unreplayable ({'; '.join(r.reasons)})")
    if r.tie_unrecorded:
        extra.append(f"{r.tie_unrecorded} ties in records without a seed")
    if r.approximate:
        extra.append(
            f"{r.approximate} decisions of cost-aware policies replayed on a rebuilt activity "
            f"table: {r.approximate - r.approximate_mismatched} came out the same"
        )
    if r.mismatched:
        extra.append(f"{r.mismatched} MISMATCHED")
    if extra:
        lines.append("  " + "; ".join(extra))
    for m in r.mismatches[:listed]:
        lines.append(f"  mismatch {m['request_id']} (router {m['router_id']}): {m['detail']}")
    cf = report.counterfactual
    if cf is not None:
        changes = ", ".join(f"{k} {v}" for k, v in cf.changes.items())
        lines.append("")
        lines.append(f"what-if: {changes} (replayed as {cf.policy})")
        lines.append(
            f"  decisions changed: {cf.changed:,} of {cf.decisions:,} "
            f"({100.0 * cf.changed_share:.1f}%)"
            + (f"; {cf.kept} kept as recorded (partition missing)" if cf.kept else "")
        )
        workers = sorted(set(cf.before.per_worker) | set(cf.after.per_worker))
        lines.append(f"  {'worker':<16} {'before':>8} {'after':>8}")
        for w in workers:
            n_before, n_after = cf.before.per_worker.get(w, 0), cf.after.per_worker.get(w, 0)
            lines.append(f"  {w:<16} {n_before:>8,} {n_after:>8,}")
        if cf.similarity_decisions:
            versions = ", ".join(str(v) for v in cf.reference_partitions)
            lines.append(
                f"  mean signature-centroid similarity of the chosen worker: "
                f"{_num(cf.before.similarity_mean)} -> {_num(cf.after.similarity_mean)} "
                f"over {cf.similarity_decisions:,} decisions (partition version {versions})"
            )
        lines.append(
            f"  mean load of the chosen worker when chosen: {_num(cf.before.chosen_load_mean, 2)}"
            f" -> {_num(cf.after.chosen_load_mean, 2)}"
        )
        if cf.before.fallbacks or cf.after.fallbacks:
            lines.append(
                f"  fallbacks: {cf.before.fallbacks or '-'} -> {cf.after.fallbacks or '-'}"
            )
        for moved in cf.moves[:listed]:
            lines.append(f"  moved {moved['request_id']}: {moved['from']} -> {moved['to']}")
        if cf.changed > min(listed, len(cf.moves)):
            lines.append(f"  ... and {cf.changed - min(listed, len(cf.moves)):,} more")
        lines.append(f"  load model: {cf.load_model}")
        if cf.activity_model is not None:
            lines.append(f"  activity: {cf.activity_model}")
        if cf.candidates_only:
            lines.append(
                f"  {cf.candidates_only:,} decisions of a fleet-scale profile list only the "
                "candidates they read: the what-if chose among those"
            )
        effect = cf.modelled
        if effect is None:
            lines.append("  modelled decode effect: no decode summaries in the window")
        else:
            b, a = effect.before, effect.after
            geometry = f"{effect.num_moe_layers}x{effect.num_experts}"
            lines.append(
                f"  modelled decode effect ({effect.profiled:,} of {effect.requests:,} requests "
                f"with decode summaries, {geometry} experts, batches sampled every "
                f"{effect.sample_s:.3g} s, deployment {effect.cost_profile or '-'}):"
            )
            lines.append(
                f"    expert union per MoE layer per step: {b.expert_union_per_layer:.3f} -> "
                f"{a.expert_union_per_layer:.3f}"
                f"{_pct(b.expert_union_per_layer, a.expert_union_per_layer)}; batch "
                f"{b.batch_mean:.2f} -> {a.batch_mean:.2f}"
            )
            if b.tpot_mean_ms is not None:
                lines.append(
                    f"    TPOT mean {_num(b.tpot_mean_ms, 2)} -> {_num(a.tpot_mean_ms, 2)} ms"
                    f"{_pct(b.tpot_mean_ms, a.tpot_mean_ms)}, P50 {_num(b.tpot_p50_ms, 2)} -> "
                    f"{_num(a.tpot_p50_ms, 2)} ms{_pct(b.tpot_p50_ms, a.tpot_p50_ms)}, P95 "
                    f"{_num(b.tpot_p95_ms, 2)} -> {_num(a.tpot_p95_ms, 2)} ms"
                    f"{_pct(b.tpot_p95_ms, a.tpot_p95_ms)}"
                )
            measured = effect.measured_tpot_p50_ms
            if measured is not None:
                lines.append(
                    f"    (the decode workers measured TPOT P50 {measured:.2f} ms for the "
                    "recorded decisions)"
                )
            for note in effect.notes:
                lines.append(f"    note: {note}")
    for note in report.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def plot_report(report: ReplayReport, path: Path) -> None:
    """Per-worker assignments, changes over time, and modelled TPOT, before and after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cf = report.counterfactual
    fig, axes = plt.subplots(1, 3 if cf is not None else 1, figsize=(15 if cf else 6, 4.2))
    axes = np.atleast_1d(axes)
    r = report.reproduction
    if cf is None:
        ax = axes[0]
        labels = [
            "reproduced",
            "mismatched",
            "anchored",
            "unreplayable",
            "tie (no seed)",
            "approximate",
        ]
        values = [
            r.reproduced,
            r.mismatched,
            r.anchored,
            r.unreplayable,
            r.tie_unrecorded,
            r.approximate,
        ]
        colors = ["tab:green", "tab:red", "tab:gray", "tab:gray", "tab:orange", "tab:olive"]
        ax.bar(labels, values, color=colors)
        ax.set_title(f"replay as recorded: {r.reproduced}/{r.checked} reproduced")
        ax.tick_params(axis="x", labelrotation=20)
    else:
        changes = ", ".join(f"{k} {v}" for k, v in cf.changes.items())
        fig.suptitle(f"what-if {changes}: {cf.changed}/{cf.decisions} decisions changed")
        ax = axes[0]
        workers = sorted(set(cf.before.per_worker) | set(cf.after.per_worker))
        x = np.arange(len(workers))
        ax.bar(x - 0.2, [cf.before.per_worker.get(w, 0) for w in workers], 0.4, label="recorded")
        ax.bar(x + 0.2, [cf.after.per_worker.get(w, 0) for w in workers], 0.4, label="replayed")
        ax.set_xticks(x, workers, rotation=45, ha="right")
        ax.set_ylabel("decisions")
        ax.set_title("assignments per worker")
        ax.legend()
        ax = axes[1]
        t0 = cf.decided_at_s[0] if cf.decided_at_s else 0.0
        decided = np.asarray(cf.decided_at_s) - t0
        changed = np.asarray(cf.changed_at_s) - t0
        ax.plot(decided, np.arange(1, len(decided) + 1), label="decisions")
        ax.plot(changed, np.arange(1, len(changed) + 1), label="changed")
        ax.set_xlabel("seconds into the window")
        ax.set_ylabel("cumulative count")
        ax.set_title("changed decisions over time")
        ax.legend()
        ax = axes[2]
        m = cf.modelled
        if m is not None and m.tpot_before_ms is not None and m.tpot_after_ms is not None:
            for label, tpot in (("recorded", m.tpot_before_ms), ("replayed", m.tpot_after_ms)):
                xs = np.sort(tpot)
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)
            ax.set_xlabel("modelled TPOT (ms)")
            ax.set_ylabel("share of requests")
            ax.set_title(f"modelled TPOT ({m.cost_profile})")
            ax.legend()
        else:
            ax.text(0.5, 0.5, "no decode summaries: no modelled TPOT", ha="center", va="center")
            ax.set_axis_off()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- explain --------------------------------------------------------------------------------


async def _explain_from_nats(request_id: str, timeout_s: float) -> tuple[Any, Any, Any, str]:
    """(decision or None, partition or None, summary or None, what was searched)."""
    from eldr.bus import stream_name
    from eldr.bus.topology import DECISIONS
    from eldr.partitions.codec import partition_from_blob
    from eldr.replay.source import fetch_decision, fetch_partition_version, fetch_summary

    bus = await _connect("explain")
    try:
        decision = await fetch_decision(bus, request_id)
        stream = stream_name(bus.subjects.namespace, DECISIONS)
        if decision is None:
            state = await bus.stream_state(stream)
            where = (
                f"namespace {bus.subjects.namespace!r} (stream {stream} holds "
                f"{state.messages:,} decisions, seq {state.first_seq}..{state.last_seq})"
            )
            return None, None, None, where
        partition = None
        if decision.partition_version is not None:
            blob = await fetch_partition_version(bus, decision.partition_version, timeout_s)
            if blob is not None:
                partition = partition_from_blob(blob)
        summary = await fetch_summary(bus, decision, timeout_s)
        return decision, partition, summary, f"namespace {bus.subjects.namespace!r}"
    finally:
        await bus.drain()


def _cmd_explain(args: argparse.Namespace) -> int:
    from eldr.partitions.codec import partition_from_blob
    from eldr.replay.eventlog import format_ts
    from eldr.replay.explain import explain

    if args.file is not None:
        loaded = _load_file("explain", args.file)
        if isinstance(loaded, str):
            return _fail("explain", loaded)
        decision = loaded.decision(args.request_id)
        where = f"{args.file} ({len(loaded.decisions):,} decisions)"
        partition = summary = None
        if decision is not None:
            blob = (
                None
                if decision.partition_version is None
                else loaded.partition_blob(decision.partition_version)
            )
            partition = None if blob is None else partition_from_blob(blob)
            summary = loaded.summaries.get(args.request_id)
    else:
        found = _run_nats("explain", _explain_from_nats(args.request_id, args.timeout))
        if found is None:
            return EXIT_ERROR
        decision, partition, summary, where = found
    if decision is None:
        return _fail(
            "explain", f"no decision recorded for request id {args.request_id!r} in {where}"
        )
    if not decision.assigned:
        print(
            f"request {decision.request_id}: expired. Router {decision.router_id} took its "
            f"PrefillDone at {format_ts(decision.ts_s)}, after the requester's deadline, and "
            "assigned no worker (the requester had chosen one itself)."
        )
        return EXIT_OK
    explanation = explain(decision, partition, summary)
    if args.json:
        print(json.dumps(explanation.as_dict(), indent=2))
    else:
        print(explanation.render())
    return EXIT_OK
