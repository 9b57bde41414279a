"""bench/run: run named benchmark scenarios, write their JSON results, regenerate docs/benchmarks.md's tables.

    bench/run --list                      # the scenarios and the systems each takes
    bench/run --quick                     # every scenario, small sizes and time budgets
    bench/run                             # every scenario, full sizes
    bench/run --scenario rocksdb --scenario files --repeats 3
    bench/run --scenario rocksdb --systems local,fusestate-file --mount-options '--durability local'
    bench/run --report-only               # regenerate the tables and plots from docs/bench-data/
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from bench import machine
from bench.common import (DATA_DIR, RESULTS_DIR, Choices, Context, Shape, error_text, log, result_doc, scrub, text_table,
                          write_result)
from bench.scenarios import SCENARIOS
from bench.systems import detach_all_under

DEFAULT_REPEATS = {"tiny": 1, "quick": 2, "full": 3}


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    epilog = "\n".join(["systems (--systems; which scenario takes which, and runs which without it: --list):",
                         *wrapped(list(map(quoted, all_systems())), "  ", 100)])
    p = argparse.ArgumentParser(prog="bench/run", description=__doc__, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", dest="size", const="quick",
                      help="small sizes; a scenario repeats only while its time budget allows")
    size.add_argument("--tiny", action="store_const", dest="size", const="tiny",
                      help="smallest sizes, for testing the harness (implies --no-report)")
    p.add_argument("--scenario", action="append", default=[], metavar="NAME",
                   help="run only this scenario (repeatable, or comma-separated)")
    p.add_argument("--systems", default=None,
                   help="only these systems, comma-separated (local is the baseline): their names are below, "
                        "--list shows which scenario takes which")
    p.add_argument("--repeats", type=int, default=None, help="repetitions per system (default 2 quick, 3 full)")
    p.add_argument("--mount-options", type=shlex.split, default=[], metavar="OPTIONS",
                   help="more `fusestate mount` options for every fusestate mount (one string, after the "
                        "scenario's own; not spark-cluster), e.g. --mount-options='--durability local'")
    p.add_argument("--state-gb", type=gb_list, default=None, metavar="GB,...",
                   help="spark-restart and spark-cluster: these state sizes (GB of keys × payload, "
                        "comma-separated, e.g. 1,4,8) instead of the size's own; other scenarios ignore it")
    p.add_argument("--db-keys", type=int, default=None, metavar="N",
                   help="rocksdb: db_bench with this many keys instead of the size's own (with --quick's "
                        "8 MiB memtables, --db-keys 600000 is a 250 MB database); other scenarios ignore it")
    p.add_argument("--key-skew", type=key_skew, default=0.0, metavar="S",
                   help="spark-restart and spark-cluster: once every key has state, the pipeline's events pick "
                        "keys from a Zipf distribution of exponent S, e.g. 1.1 (a few hot keys take most updates; "
                        "default 0: every key in turn); other scenarios ignore it")
    shape = Shape()
    p.add_argument("--shape-latency-ms", type=float, default=shape.latency_ms, metavar="MS",
                   help="fusestate-s3-shaped: time to first byte of every request (default %(default)s)")
    p.add_argument("--shape-connection-mbps", type=float, default=shape.connection_mbps, metavar="MB/S",
                   help="fusestate-s3-shaped: one connection's throughput (default %(default)s)")
    p.add_argument("--shape-node-mbps", type=float, default=shape.node_mbps, metavar="MB/S",
                   help="fusestate-s3-shaped: the node's bandwidth, each direction (default %(default)s)")
    p.add_argument("--list", action="store_true",
                   help="list the scenarios, the systems each takes and those it runs without --systems (at the "
                        "size given: full unless --quick or --tiny), and exit")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: regenerate docs/benchmarks.md's blocks (those of --scenario, else all) from "
                        "--results (default docs/bench-data)")
    p.add_argument("--no-report", action="store_true", help="write results, do not touch docs/")
    p.add_argument("--results", type=Path, default=None,
                   help="results directory (default bench/results; docs/bench-data with --report-only)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="scratch space for databases, buckets, mounts (default a fresh dir under /var/tmp)")
    p.add_argument("--keep", action="store_true", help="keep the scratch space")
    p.add_argument("--no-budget", action="store_true", help="ignore the per-scenario time budgets of --quick")
    args = p.parse_args(argv)
    args.size = args.size or "full"
    args.scenario = [s for item in args.scenario for s in item.split(",") if s]
    unknown = [s for s in args.scenario if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {', '.join(unknown)}; --list shows them")
    return args


def gb_list(text: str) -> list[float]:
    """--state-gb 1,4,8: positive sizes in GB."""
    try:
        sizes = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GB sizes such as 1,4,8, got {text!r}") from None
    if not sizes or any(size <= 0 for size in sizes):
        raise argparse.ArgumentTypeError(f"expected positive GB sizes such as 1,4,8, got {text!r}")
    return sizes


def key_skew(text: str) -> float:
    """--key-skew 1.1: a Zipf exponent, 0 for uniform keys."""
    try:
        skew = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 such as 1.1, got {text!r}") from None
    if not math.isfinite(skew) or skew < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 such as 1.1, got {text!r}")
    return skew


def list_scenarios(size: str = "full", columns: int = 110) -> None:
    """Each scenario, its summary and its systems: those it runs without --systems at ``size``
    (``default``), the others it takes (``also``), and names that stand for several (``groups``)."""
    width = max(map(len, SCENARIOS))
    for name, mod in SCENARIOS.items():
        budget = mod.BUDGET.get("quick")
        print(f"{name:<{width}}  {mod.SUMMARY}" + (f"  [quick: ≤{budget / 60:.1f} min]" if budget else ""))
        for line in systems_lines(mod.choices(size), indent=width + 4, columns=columns):
            print(line)


def systems_lines(choices: Choices, *, indent: int, columns: int) -> list[str]:
    """A scenario's systems, under labels aligned at ``indent``, wrapped at ``columns`` (a name is never cut)."""
    default = set(choices.default)
    parts = {"default": [n for n in choices.accepted if n in default],
             "also": [n for n in choices.accepted if n not in default],
             "groups": [f"{quoted(n)} ({what})" for n, what in choices.groups.items()]}
    lines = []
    for label, items in parts.items():
        if items:
            words = [f"{n}," for n in items[:-1]] + items[-1:] if label == "groups" else list(map(quoted, items))
            lines += wrapped(words, " " * indent + f"{label + ':':<9}", columns)
    return lines


def wrapped(words: list[str], head: str, columns: int) -> list[str]:
    """``words`` after ``head``, as many on a line as fit in ``columns`` (at least one); the next
    lines indented as far as the first's words."""
    lines, line, first = [], head, True
    for word in words:
        if not first and len(line) + 1 + len(word) > columns:
            lines.append(line)
            line, first = " " * len(head), True
        line += word if first else " " + word
        first = False
    return lines + [line]


def quoted(name: str) -> str:
    """A system's name as it would be typed: quoted if it holds a space or a comma."""
    return shlex.quote(name) if any(c in name for c in " ,") else name


def all_systems() -> list[str]:
    """Every name --systems takes, in the scenarios' order, each once."""
    return list(dict.fromkeys(n for mod in SCENARIOS.values() for size in ("full", "quick")
                              for n in [*mod.choices(size).accepted, *mod.choices(size).groups]))


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_scenarios(args: argparse.Namespace) -> list[Path]:
    names = args.scenario or list(SCENARIOS)
    results_dir = args.results or RESULTS_DIR
    base = args.workdir or Path(tempfile.mkdtemp(prefix="fusestate-bench-", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    systems = [s for s in args.systems.split(",") if s] if args.systems else None
    repeats = args.repeats or DEFAULT_REPEATS[args.size]
    info = machine.describe()
    written: list[Path] = []
    kept: list[Path] = []  # scenario work dirs left in place because a run failed
    log(f"work dir {base}; size {args.size}; {repeats} repetition(s); scenarios {', '.join(names)}")
    log(f"machine: {machine.summary_line(info)}")
    try:
        for name in names:
            mod = SCENARIOS[name]
            budget = None if args.no_budget else mod.BUDGET.get(args.size)
            work = base / name
            ctx = Context(work=work, size=args.size, repeats=repeats, systems=systems, budget_seconds=budget,
                          mount_options=args.mount_options, state_gb=args.state_gb, db_keys=args.db_keys,
                          key_skew=args.key_skew,
                          shape=Shape(args.shape_latency_ms, args.shape_connection_mbps, args.shape_node_mbps))
            started = dt.datetime.now()
            log(f"== {name}: {mod.SUMMARY}")
            body: dict = {"error": "interrupted", "systems": [], "summary": []}
            try:
                body = mod.run(ctx)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001 - one broken scenario must not lose the others
                log(f"  {name} failed: {error_text(exc)}")
                body = {"error": error_text(exc), "systems": [], "summary": []}
            finally:
                detach_all_under(work)
                if failed(body):
                    kept.append(work)  # its logs are how a failure is understood
                elif not args.keep:
                    shutil.rmtree(work, ignore_errors=True)
            doc = scrub(result_doc(name, ctx, started, info, **body), base)
            path = write_result(doc, results_dir)
            written.append(path)
            if "error" not in body:
                table = mod.terminal(doc) if hasattr(mod, "terminal") else text_table(doc["summary"], doc["systems"])
                print(f"\n{mod.TITLE} ({doc['duration_seconds']:.0f} s)\n{table}\n", flush=True)
            log(f"  {name}: {doc['duration_seconds']:.0f} s, results {path}")
    finally:
        detach_all_under(base)
        if kept:
            log("kept for their logs (a run failed): " + ", ".join(str(k) for k in kept))
        elif not args.keep and args.workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    return written


def failed(body: dict) -> bool:
    """Whether the scenario, or one of its runs, ended in an error."""
    return bool(body.get("error")) or any(r.get("error") for r in body.get("runs", []))


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.list:
        list_scenarios(args.size)
        return 0
    signal.signal(signal.SIGTERM, _terminate)
    from bench import report

    if args.report_only:
        source = args.results or DATA_DIR
        out = report.generate(source, copy_to=None if source.resolve() == DATA_DIR.resolve() else DATA_DIR,
                              only=args.scenario or None)
        log(f"report written to {out}")
        return 0
    t = time.monotonic()
    run_scenarios(args)
    log(f"all scenarios done in {time.monotonic() - t:.0f} s")
    if args.no_report or args.size == "tiny":
        return 0
    out = report.generate(args.results or RESULTS_DIR, copy_to=DATA_DIR,
                          only=args.scenario or None)
    log(f"report written to {out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted")
        sys.exit(130)
