"""Scenario 6: the Spark state pipeline, local disk vs fusestate, through bench/spark_runner.py.

The runner runs its setups one after the other in one call (local disk, fusestate
with a ``file://`` checkpoint, fusestate with the ``fusestate://`` shim), so repeated calls
interleave them. Each call reports records/s and state commit latency over the batches
after the first, and the restart: for fusestate after killing the daemon and wiping its
cache (a fresh node), the time from the restart to the first completed batch.

A second call per repetition runs on the shaped S3 endpoint (``fusestate-s3-shaped``'s):
fusestate+shim on one of its buckets, against what jobs run today, ``s3a`` (the state on local
disk, the checkpoint in one of its buckets through Hadoop's S3A connector, which bench/s3a.py
fetches from Maven Central), and local disk whose checkpoint sits in one of its buckets and is
downloaded by the fresh node before the restart.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from bench.common import (BIN, ROOT, Choices, Context, Metric, error_text, log, record, run_cmd, runtime_dir_for,
                          summarize)
from bench.render import bars_from_rows, goal_row, medians_note, ratio_table
from bench.endpoints import ShapedMoto
from bench.s3a import ConnectorUnavailable, connector_jars
from bench.systems import SHAPED, detach_all_under

NAME = "spark"
TITLE = "Spark state pipeline"
SUMMARY = "Spark Structured Streaming on the RocksDB state store: records/s, commit latency, restart to first batch"
BUDGET = {"tiny": None, "quick": 150.0, "full": None}
SETUPS = ["local", "fusestate", "fusestate+shim"]
# On the shaped S3 endpoint: fusestate+shim, the checkpoint through Hadoop's S3A connector (the
# state on local disk), and local disk whose checkpoint a fresh node downloads before restarting
# (file by file as Spark's state store copies; all at once).
S3A = "s3a"
SHAPED_SETUPS = [S3A, "local+download", "local+download-parallel", "fusestate+shim@s3"]
# fusestate+shim@s3 restarted another way (bench/spark_runner.py's VARIANTS, several joined by +, as
# in fusestate+shim@s3:trace+no-changelog): run only when --systems names them.
SHAPED_VARIANTS = ["fusestate+shim@s3:whole", "fusestate+shim@s3:tails", "fusestate+shim@s3:trace",
                   "fusestate+shim@s3:same-node", "fusestate+shim@s3:no-changelog", "fusestate+shim@s3:changelog",
                   "fusestate+shim@s3:untracked"]
VARIANT_OF_SHAPED = "fusestate+shim@s3:"
# Names --systems takes for several setups at once (chosen_setups, shaped_setups).
GROUPS = {"fusestate-file": "every fusestate setup off the endpoint", SHAPED: "every setup on the shaped endpoint"}
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"keys": 2_000, "payload_bytes": 256, "batches": 2, "timeout": 600},
    "quick": {"keys": 20_000, "payload_bytes": 512, "batches": 3, "timeout": 600},
    # A few GB of state, as the restart goal asks: 500k keys x 4 KiB, uncompressed. Four batches,
    # so that records/s is measured over three (single batches moved by +-15% between runs), and
    # three repetitions of the two setups the goals name (about seven minutes each). Every
    # setup runs with the settings the setup helper writes by default: changelog
    # checkpointing, a snapshot every version with the shim, every 10 versions without.
    "full": {"keys": 500_000, "payload_bytes": 4096, "batches": 4, "timeout": 3600, "repeats": 3,
             "setups": ["local", "fusestate+shim"],
             "extra": ["--restart-events", "5000", "--state-compression", "none"]},
}
METRICS = [
    Metric("records_per_s", "records/s", label="records/s (after the first batch)"),
    Metric("batch_ms_median", "ms", higher_is_better=False, label="median batch time"),
    Metric("commit_ms_median", "ms", higher_is_better=False, label="median state commit"),
    Metric("commit_ms_max", "ms", higher_is_better=False, label="slowest state commit"),
    Metric("restart_s", "s", higher_is_better=False, label="restart to first batch done"),
    Metric("restart_fetched_bytes", "B", higher_is_better=False, label="bytes fetched by the restart"),
]


def keys_text(key_skew: float) -> str:
    """How a result's pipeline picked its keys (``--key-skew``), for the text beside its table."""
    return f"Zipf keys, s = {key_skew:g}, once every key has state" if key_skew else "uniform keys"


def skew_suffix(key_skew: float) -> str:
    """A variant's mark of skewed keys (none for uniform keys): results at two skews never share a label."""
    return f" (Zipf {key_skew:g})" if key_skew else ""


def skew_arguments(key_skew: float) -> list[str]:
    """The pipeline's (and the runner's) ``--key-skew``, left out for uniform keys."""
    return ["--key-skew", str(key_skew)] if key_skew else []


def metrics_of(setup: dict[str, Any]) -> dict[str, float]:
    first, restart = setup.get("first_run", {}), setup.get("restart", {})
    out = {"records_per_s": first.get("records_per_second"), "batch_ms_median": first.get("batch_ms_median"),
           "commit_ms_median": first.get("state_commit_ms_median"), "commit_ms_max": first.get("state_commit_ms_max"),
           "restart_s": restart.get("to_first_batch_done_s"), "restart_fetched_bytes": restart.get("fetched_bytes")}
    return {k: v for k, v in out.items() if v is not None}


def choices(size: str) -> Choices:
    """The setups ``--systems`` may name here, and those run without it at ``size``."""
    return Choices(SETUPS + SHAPED_SETUPS, SIZES[size].get("setups", SETUPS) + SHAPED_SETUPS, GROUPS)


def chosen_setups(ctx: Context, names: list[str]) -> list[str]:
    """The setups --systems asks for; fusestate-file stands for every fusestate setup."""
    return [s for s in names if not ctx.systems or s in ctx.systems
            or (s.startswith("fusestate") and "fusestate-file" in ctx.systems)]


def spark_env(ctx: Context) -> dict[str, str]:
    return dict(os.environ, FUSESTATE_RUNTIME_DIR=runtime_dir_for(ctx.work))


def call_runner(ctx: Context, p: dict[str, Any], setups: list[str], tag: str,
                env: dict[str, str], runner_args: Sequence[str] = ()) -> dict[str, Any]:
    """One bench/spark_runner.py call (its setups one after the other, over one input); its JSON."""
    out, work = ctx.work / f"spark-{tag}.json", ctx.work / f"w-{tag}"
    cmd = [str(BIN / "python"), "-m", "bench.spark_runner", "--keys", str(p["keys"]),
           "--payload-bytes", str(p["payload_bytes"]), "--batches", str(p["batches"]),
           "--setups", ",".join(setups), "--work", str(work), "--output", str(out), *p.get("extra", []),
           *runner_args]
    if ctx.mount_options:
        cmd += ["--mount-options", shlex.join(ctx.mount_options)]
    try:
        run_cmd(cmd, timeout=p["timeout"], env=env, cwd=ROOT)
        return json.loads(out.read_text())
    finally:
        # One call at full size leaves 20-40 GB (states, buckets that keep every block for the
        # GC grace, caches): a third repetition ran out of disk before this went.
        detach_all_under(work)
        shutil.rmtree(work, ignore_errors=True)


def runner_records(ctx: Context, p: dict[str, Any], setups: list[str], env: dict[str, str], *, repeat: int,
                   variant: str, label: str, metrics_of: Callable[[dict[str, Any]], dict[str, float]],
                   runner_args: Sequence[str] = ()) -> list[dict[str, Any]]:
    """One runner call as one record per setup: its metrics, or the error that stopped it."""
    try:
        doc = call_runner(ctx, p, setups, f"{p['keys']}-r{repeat}-{len(runner_args)}", env, runner_args)
    except Exception as exc:  # noqa: BLE001 - the whole call failed: every setup gets the error
        log(f"  {label}: ERROR {error_text(exc)}")
        return [record(s, repeat, variant, error=error_text(exc)) for s in setups]
    records = []
    for s in setups:
        if s not in doc.get("setups", {}):
            records.append(record(s, repeat, variant, error="no result from the runner"))
            continue
        m = metrics_of(doc["setups"][s])
        records.append(record(s, repeat, variant, m, raw=doc["setups"][s]))
        log(f"  {label} {s:<15} " + " ".join(f"{k}={v:,.1f}" for k, v in m.items()))
    return records


def shaped_setups(ctx: Context) -> list[str]:
    """The setups on the shaped S3 endpoint: all of them with no --systems or with the endpoint's
    system among them, else those --systems names."""
    named = [s for s in ctx.systems or [] if s.startswith(VARIANT_OF_SHAPED)]
    if not ctx.systems or SHAPED in ctx.systems:
        return list(SHAPED_SETUPS) + named
    return [s for s in SHAPED_SETUPS if s in ctx.systems] + named


def fetch_connector(setups: list[str]) -> tuple[list[str], Optional[str]]:
    """Fetch S3A's jars before the first run when ``s3a`` is among ``setups``: the setups that can
    run, and why s3a cannot (its cells get that error; the other setups run). ``s3a:<variant>``
    counts as s3a."""
    if not any(s.partition(":")[0] == S3A for s in setups):
        return setups, None
    try:
        jars = connector_jars()
    except ConnectorUnavailable as exc:
        log(f"  s3a: {exc}")
        return [s for s in setups if s.partition(":")[0] != S3A], str(exc)
    log(f"  s3a: Hadoop's S3A connector, {len(jars)} jars ({jars[0].name})")
    return setups, None


def run(ctx: Context) -> dict[str, Any]:
    p = dict(ctx.pick(SIZES))
    setups = chosen_setups(ctx, p.get("setups", SETUPS))
    on_s3, no_s3a = fetch_connector(shaped_setups(ctx))
    env = spark_env(ctx)
    runs: list[dict[str, Any]] = [record(S3A, 0, "", error=no_s3a)] if no_s3a else []
    with contextlib.ExitStack() as stack:
        endpoint = stack.enter_context(ShapedMoto(ctx.work / "shaped-s3", ctx.shape)) if on_s3 else None
        for repeat in ctx.repetitions():
            if repeat >= p.get("repeats", ctx.repeats):
                break
            label = f"spark r{repeat + 1}"
            if setups:  # none when --systems names only setups on the endpoint
                runs += runner_records(ctx, p, setups, env, repeat=repeat, variant="", label=label,
                                       metrics_of=metrics_of)
            if endpoint is not None:
                runs += runner_records(ctx, p, on_s3, env, repeat=repeat, variant="", label=label,
                                       metrics_of=metrics_of, runner_args=["--s3-endpoint", endpoint.endpoint])
    names = setups + on_s3 + ([S3A] if no_s3a else [])
    return {"params": {**p, "setups": names, "shape": ctx.shape.describe() if on_s3 else None}, "systems": names,
            "summary": summarize(runs, METRICS, names, [""]), "runs": runs,
            "raw_state_bytes": p["keys"] * p["payload_bytes"]}


def checkpointing_text(doc: dict[str, Any]) -> Optional[str]:
    """Which setups of a result ran with RocksDB changelog checkpointing and which with a snapshot on
    every commit, as the runner recorded it; None for a result from before it recorded that (its
    text then says what the setup helper's defaults were at the time)."""
    modes: dict[str, set[bool]] = {}
    for run in doc.get("runs", []):
        if run.get("error") is None:
            modes.setdefault(run["system"], set()).add((run.get("raw") or {}).get("changelog"))
    if not modes or any(None in m or len(m) != 1 for m in modes.values()):
        return None
    on = [f"*{s}*" for s, m in modes.items() if True in m]
    off = [f"*{s}*" for s, m in modes.items() if False in m]
    parts = ([f"changelog checkpointing for {', '.join(on)}"] if on else []) + (
        [f"a snapshot on every commit (no changelog) for {', '.join(off)}"] if off else [])
    return "; ".join(parts) + ". "


def render(doc: dict[str, Any], img_dir: Path, img_rel: str) -> str:
    p, names, rows = doc["params"], doc["systems"], doc["summary"]
    flags = " ".join(p.get("extra", []))
    checkpointing = checkpointing_text(doc) or (
        "local disk with changelog checkpointing, the fusestate setups without (a snapshot every commit). "
        if "--no-changelog" in flags else
        "every setup with changelog checkpointing, a snapshot every version with the shim and every 10 "
        "versions without. ")
    parts = [f"The pipeline (`fusestate spark-pipeline`: per-key aggregation and deduplication on the RocksDB "
             f"state store, 4 partitions) over {p['keys']:,} keys × {p['payload_bytes']:,} B in {p['batches']} "
             f"batches{f' (`{flags}`)' if flags else ''}, then a kill and a restart; "
             + checkpointing + f"*local*: state and checkpoint "
             f"on local disk; *fusestate*: a `file://` mount with a `file://` checkpoint; "
             f"*fusestate+shim*: the same mount with the `fusestate://` checkpoint; mounts use `--scratch "
             f"'blockmgr-*'` (Spark's shuffle files stay on the node). The restart: fusestate's daemon killed and its "
             f"cache dir wiped (a fresh node), the page cache dropped for every setup. "
             + (f"On the shaped S3 endpoint ({p['shape']}): *fusestate+shim@s3* is fusestate+shim on one of its "
                f"buckets; " + (S3A_TEXT if S3A in names else "") + f"*local+download* keeps the state on local disk and its checkpoint in one of its buckets, "
                f"which the fresh node downloads before the restart, file by file as Spark's state store copies "
                f"them (*-parallel*: all at once, a generous bound); their restart includes that download. "
                if p.get("shape") else "") + medians_note(doc),
             ratio_table(rows, names, show_variant=False)]
    by = {r["metric"]: r for r in rows}
    lat = [by[m] for m in ("commit_ms_median", "commit_ms_max", "batch_ms_median") if m in by]
    if lat:
        img = bars_from_rows(img_dir / "spark-latency.png", lat, names, ylabel="ms",
                             title="Spark state pipeline: batch and commit latency")
        parts.append(f"![spark latency]({img_rel}/{img.name})")
    return "\n\n".join(parts)


S3A_TEXT = ("*s3a* is what most jobs run today: the state on local disk, the checkpoint in one of its buckets "
            "through Hadoop's S3A connector (`hadoop-aws` matching Spark's Hadoop, S3A's defaults, Spark's own "
            "checkpoint file manager), restarted with its local state dir removed, so that Spark downloads what it "
            "loads; ")


def s3a_goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The goals of the s3a issue, fusestate+shim on the same endpoint against s3a: median state
    commit at most half of s3a's, records/s at least s3a's, a restart at most 0.4 of s3a's."""
    by = {r["metric"]: r for r in doc.get("summary", [])}
    mine_name = "fusestate+shim@s3"
    out = []
    for metric, what, limit, lower in (("commit_ms_median", "median state commit", 0.5, True),
                                       ("records_per_s", "steady records/s", 1.0, False),
                                       ("restart_s", "restart to the first completed batch", 0.4, True)):
        cells = by.get(metric, {}).get("systems", {})
        base, mine = (cells.get(n, {}).get("median") for n in (S3A, mine_name))
        if not base or not mine:
            continue
        ratio = mine / base
        unit = by[metric]["unit"]
        digits = 1 if unit == "s" else 0
        out.append(goal_row(f"Spark pipeline, {what}, {mine_name} / s3a {'≤' if lower else '≥'} {limit:g}",
                            f"{ratio:.2f} ({mine:,.{digits}f} {unit} against {base:,.{digits}f} {unit})",
                            ratio <= limit if lower else ratio >= limit))
    return out


def goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The Spark issue's two goals, for every fusestate setup that ran: steady records/s at
    least 0.9 of local disk, and a restart to the first completed batch at least 5x faster
    than local disk with changelog checkpointing (the shim on a fresh cache dir)."""
    by = {r["metric"]: r for r in doc.get("summary", [])}
    out = []
    rate, restart = by.get("records_per_s"), by.get("restart_s")
    for name in [n for n in doc.get("systems", []) if n.startswith("fusestate")]:
        ratio = rate["ratio"].get(name) if rate else None
        if ratio is not None:
            out.append(goal_row(f"Spark pipeline, steady records/s, {name} / local ≥ 0.9",
                                f"{ratio:.2f} ({rate['systems'][name]['median']:,.0f} against "
                                f"{rate['systems']['local']['median']:,.0f} records/s)", ratio >= 0.9))
    commit = by.get("commit_ms_median")
    for name in [n for n in doc.get("systems", []) if n.startswith("fusestate")] if commit else []:
        # Local disk's commit: the local setup's, or on the shaped endpoint local+download's.
        bases = ("local+download", "local") if name.endswith("@s3") else ("local", "local+download")
        base = next((commit["systems"].get(b, {}).get("median") for b in bases
                     if commit["systems"].get(b, {}).get("median")), None)
        mine = commit["systems"].get(name, {}).get("median")
        if base and mine:
            out.append(goal_row(f"Spark pipeline, median state commit, {name} / local disk ≤ 2",
                                f"{mine / base:.2f} ({mine:,.0f} ms against {base:,.0f} ms)", mine / base <= 2))
    cells = restart["systems"] if restart else {}
    local, shim = (cells.get(n, {}).get("median") for n in ("local", "fusestate+shim"))
    if local and shim:
        out.append(goal_row("Spark pipeline, restart to the first completed batch, local (changelog) / "
                            "fusestate+shim on a fresh cache dir ≥ 5",
                            f"{local / shim:.2f}× ({shim:.1f} s against {local:.1f} s)", local / shim >= 5))
    return out + s3a_goals(doc)
