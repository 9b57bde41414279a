"""Paired restart trials: one Spark state built once, restarted many times from the same bytes.

Restarts of one bucket one after another drift (each adds its batch and compacts), and
identical restarts still spread by about ±10% on a 2-core machine: a change to the read
path can only be judged in interleaved pairs on identical copies of one state. ``build``
runs the pipeline with fusestate+shim into a bucket and kills the daemon, as a lost node
would. ``run`` restarts that state once per variant (extra ``fusestate mount`` options)
per round, interleaved, each time on a fresh hard-linked copy of the bucket (objects are
never rewritten in place: every put is a temp file and a rename), a fresh cache dir and
an empty page cache, into a small batch. One JSON line per trial on stdout, then the
medians per variant and each variant's differences from the first, round by round.

    .venv/bin/python bench/restart_trials.py build --work /var/tmp/rt --keys 1000000 \\
        --payload-bytes 4096 --events-per-batch 125000 --batches 9          # 4.1 GB, ~8 min
    .venv/bin/python bench/restart_trials.py run --work /var/tmp/rt --rounds 5 \\
        --variant default= --variant 'no-readahead=--readahead 0'
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import median_or_none  # noqa: E402
from bench.spark_bench import drop_page_cache, lose_node, mount_file_bucket, pipeline, status, unmount  # noqa: E402
from bench.systems import free_port  # noqa: E402

PIPELINE_FLAGS = ["--state-compression", "none", "--use-shim", "--no-changelog"]


def common_args(p: dict[str, Any]) -> list[str]:
    return ["--keys", str(p["keys"]), "--payload-bytes", str(p["payload_bytes"]),
            "--events-per-batch", str(p["events_per_batch"]), *PIPELINE_FLAGS]


def build(args: argparse.Namespace) -> int:
    work = Path(args.work)
    if (work / "base").exists():
        raise SystemExit(f"{work}/base exists: use another --work, or remove it to build again")
    params = {k: getattr(args, k) for k in ("keys", "payload_bytes", "events_per_batch", "batches")}
    mnt, cache = work / "mnt", work / "build-cache"
    for d in (work / "base", mnt):
        d.mkdir(parents=True)
    mount_file_bucket(work / "base", mnt, cache, "--metrics-addr", "off")
    try:
        report = pipeline("build", mnt / "job", work / "out", work / "input", args.batches, common_args(params))
        lose_node(mnt, cache)
    finally:
        unmount(mnt)
        shutil.rmtree(cache, ignore_errors=True)
    params["records_per_second"] = report["summary"]["records_per_second"]
    (work / "base.json").write_text(json.dumps(params))
    print(json.dumps({"built": str(work / "base"), **params}))
    return 0


def scrape(port: int) -> dict[tuple[str, str], float]:
    """Sum and count of each latency histogram, keyed by (metric, label value)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return parse_histograms(text)


def parse_histograms(text: str) -> dict[tuple[str, str], float]:
    """Prometheus text -> {(sample name, its source/op label): value} for sums and counts."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_sum", "_count")):
                label = s.labels.get("source") or s.labels.get("op") or ""
                out[(s.name, label)] = s.value
    return out


def mean_ms(h: dict[tuple[str, str], float], metric: str, label: str) -> float | None:
    count = h.get((f"{metric}_count", label))
    return round(h[(f"{metric}_sum", label)] / count * 1000, 2) if count else None


def trial(work: Path, params: dict[str, Any], variant: str, options: list[str]) -> dict[str, Any]:
    copy, cache, out, mnt = work / "trial-bucket", work / "trial-cache", work / "trial-out", work / "mnt"
    for d in (copy, cache, out):
        shutil.rmtree(d, ignore_errors=True)
    subprocess.run(["cp", "-al", str(work / "base"), str(copy)], check=True)
    shutil.copytree(work / "out", out)
    port = free_port()
    mount_file_bucket(copy, mnt, cache, "--takeover", "--metrics-addr", f"127.0.0.1:{port}", *options)
    try:
        drop_page_cache()
        report = pipeline(f"restart {variant}", mnt / "job", out, work / "input", params["batches"] + 1,
                          common_args(params), "--last-batch-events", str(params["restart_events"]))
        st = status(mnt)
        h = scrape(port)
    finally:
        unmount(mnt)
        for d in (copy, cache, out):
            shutil.rmtree(d, ignore_errors=True)
    batch = report["batches"][0] if report["batches"] else {}
    return {
        "variant": variant, "restart_s": report.get("first_batch_done_s"), "jvm_and_session_s": report.get("session_start_s"),
        "first_batch_ms": batch.get("duration_ms"), "load_ms": batch.get("rocksdb", {}).get("rocksdbLoadLatencyMs"),
        # summed over the stores' tasks: reading the state, the watermark's eviction, the commits
        **{f"{part}_ms": sum(op[f"{part}_ms"] for op in batch.get("operators", []))
           for part in ("updates", "removals", "commit")},
        "fetched_bytes": st["remote"]["bytes_in"], "full_fetches": st["remote"]["full_fetches"],
        "background_fetches": st["remote"]["prefetches"], "range_reads": st["remote"]["range_reads"],
        "fuse_bytes_read": st["fuse"]["bytes_read"], "disk_cache_misses": st["cache"]["disk_misses"],
        "range_read_ms": mean_ms(h, "fusestate_block_read_seconds", "range"),
        "range_request_ms": mean_ms(h, "fusestate_remote_request_seconds", "get_range"),
    }


def summarize(trials: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    """Medians per variant; each other variant's restart minus the first's, round by round."""
    by = {v: [t for t in trials if t["variant"] == v] for v in variants}
    medians = {v: {k: m for k in ("restart_s", "fetched_bytes", "range_read_ms")
                   if (m := median_or_none(t[k] for t in ts)) is not None}
               for v, ts in by.items() if ts}
    first = by[variants[0]]
    paired = {v: [round(b["restart_s"] - a["restart_s"], 2) for a, b in zip(first, by[v])] for v in variants[1:]}
    return {"medians": medians, "restart_minus_first_s": paired}


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, options = text.partition("=")
    if not name:
        raise argparse.ArgumentTypeError(f"variant {text!r}: expected NAME=MOUNT-OPTIONS (options may be empty)")
    return name, shlex.split(options)


def run(args: argparse.Namespace) -> int:
    work = Path(args.work)
    try:
        params = json.loads((work / "base.json").read_text())
    except FileNotFoundError:
        raise SystemExit(f"no state built in {work}: run 'build' first") from None
    params["restart_events"] = args.restart_events
    variants = dict(args.variant or [("default", [])])
    trials = []
    for round_ in range(args.rounds):
        for name, options in variants.items():
            t = trial(work, params, name, options)
            t["round"] = round_
            trials.append(t)
            print(json.dumps(t), flush=True)
    print(json.dumps(summarize(trials, list(variants))))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the base state (fusestate+shim), then kill the daemon")
    b.add_argument("--work", required=True, help="directory for the base bucket, input and trials")
    b.add_argument("--keys", type=int, default=1_000_000)
    b.add_argument("--payload-bytes", type=int, default=4096)
    b.add_argument("--events-per-batch", type=int, default=125_000)
    b.add_argument("--batches", type=int, default=9)
    r = sub.add_parser("run", help="restart the base state, variants interleaved, on fresh copies")
    r.add_argument("--work", required=True)
    r.add_argument("--variant", action="append", type=parse_variant,
                   help="NAME=MOUNT-OPTIONS, repeatable; the first is the reference (default: default=)")
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--restart-events", type=int, default=5000, help="events in the batch after the restart")
    args = p.parse_args()
    return build(args) if args.command == "build" else run(args)


if __name__ == "__main__":
    sys.exit(main())
