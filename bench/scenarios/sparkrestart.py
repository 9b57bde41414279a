"""Scenario 7: the Spark pipeline's restart against state size, local disk vs fusestate+shim.

The ``spark`` scenario measures one state size. Whether a restart waits for the state is
a question of slope: how the time from the restart to the first completed batch grows
with the state. Here the batch size stays fixed (so the per-batch work, the deduplication
store and its eviction, is the same at every size) and only the number of keys grows;
each state is built by as many batches as it takes for every key to be written, then
the job stops and is restarted into a small batch (``bench/spark_runner.py``: the page cache
dropped; for fusestate the node is lost first: the daemon SIGKILLed, a fresh cache dir).

A restart also costs what no storage can take away: the JVM, the session, the query's
start and its first batch. The *floor* measures those with the same batches over a
state of a few megabytes; a restart at S GB can be at most local(S) / floor times faster
than local disk's, whatever the storage under it.

With ``fusestate-s3-shaped`` among the systems (or no ``--systems``), every size and the
floor also run on the shaped S3 endpoint (the ``spark`` scenario's setups and endpoint):
fusestate+shim on one of its buckets against ``s3a`` (the state on local disk, the checkpoint
in one of its buckets through Hadoop's S3A connector: the restarted query downloads what it
loads itself) and against local disk whose checkpoint the fresh node downloads from one of its
buckets before the query restarts (file by file, as Spark's state store copies each SST, and
all at once, a generous bound).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Optional

from bench.common import Choices, Context, Metric, record, summarize
from bench.endpoints import ShapedMoto
from bench.read_breakdown import PURPOSES
from bench.render import goal_row, md_table, medians_note, points_plot, variant_table
from bench.scenarios.spark import (GROUPS, S3A, S3A_TEXT, SHAPED_SETUPS, SHAPED_VARIANTS, checkpointing_text,
                                   chosen_setups, fetch_connector, keys_text,
                                   runner_records, shaped_setups, skew_arguments, skew_suffix, spark_env)

NAME = "spark-restart"
FLOOR = "floor"
TITLE = "Spark restart against state size"
SUMMARY = "Spark pipeline: restart to the first completed batch for growing state, fixed batch size"
BUDGET = {"tiny": None, "quick": 300.0, "full": None}
SETUPS = ["local", "fusestate+shim"]
# Every setup runs the setup helper's defaults: a snapshot on every commit with the shim (a snapshot
# costs links), changelog checkpointing and a snapshot every 10 versions without (a snapshot copies
# files). Each result records which a setup ran with (the runner's ``changelog``).
EXTRA = ["--state-compression", "none"]
# Each fusestate setup against the local-disk restart it replaces: on the shaped endpoint,
# local disk whose checkpoint is downloaded first (file by file, as Spark's state store copies).
PAIRS = [("local", "fusestate+shim"), ("local+download", "fusestate+shim@s3")]
# What most jobs run today, against fusestate on the same endpoint: the s3a issue's restart goal.
S3A_PAIR, S3A_GOAL = (S3A, "fusestate+shim@s3"), 0.4
# Under this span of state sizes, run-to-run noise (seconds) outweighs what the state adds: no slope.
MIN_SPAN_GB = 0.5
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"keys": [2_000, 6_000], "floor_keys": 200, "payload_bytes": 256, "events_per_batch": 2_000,
             "restart_events": 200, "timeout": 900, "repeats": 1},
    "quick": {"keys": [20_000, 80_000], "floor_keys": 1_000, "payload_bytes": 1024, "events_per_batch": 20_000,
              "restart_events": 1000, "timeout": 900, "repeats": 1},
    # 0.5, 2, 4 and 8 GB of state (4 KiB per key, uncompressed) built by 2, 5, 9 and 17
    # batches of 125,000 events; one repetition takes about 40 minutes. The floor: 5,000 keys
    # (20 MB) written by the same two batches of 125,000 events.
    "full": {"keys": [125_000, 500_000, 1_000_000, 2_000_000], "floor_keys": 5_000, "payload_bytes": 4096,
             "events_per_batch": 125_000, "restart_events": 5000, "timeout": 3600, "repeats": 2},
}
FLOOR_METRICS = ("restart_s", "jvm_s", "first_batch_s")
METRICS = [
    Metric("restart_s", "s", higher_is_better=False, label="restart to first batch done"),
    Metric("jvm_s", "s", higher_is_better=False, label="JVM and Spark session start"),
    Metric("first_batch_s", "s", higher_is_better=False, label="first batch"),
    Metric("download_s", "s", higher_is_better=False, label="checkpoint download (part of the restart)"),
    Metric("load_s", "s", higher_is_better=False, label="state store load (sum over stores)"),
    Metric("fetched_bytes", "B", higher_is_better=False, label="bytes fetched by the restart"),
    Metric("fetched_first_batch_bytes", "B", higher_is_better=False,
           label="bytes fetched before the first batch was done"),
    Metric("records_per_s", "records/s", label="records/s while building the state"),
]


def variant_of(keys: int, payload: int, key_skew: float = 0.0) -> str:
    """The state size as a label that keeps small sizes apart: '0.512 GB', '4.1 GB'; with
    skewed keys '4.1 GB (Zipf 1.1)', a different result from the uniform one."""
    return f"{keys * payload / 1e9:.3g} GB{skew_suffix(key_skew)}"


def gigabytes(variant: str) -> float:
    return float(variant.split()[0])


def cache_size(keys: int, p: dict[str, Any]) -> list[str]:
    """The runner's ``--cache-size`` beyond 4 GB of state. The endpoint keeps the volume on
    this machine's disk, every version the build committed (38 GB at 8 GB of state), beside
    the daemon's cache and the stores' working files: with the runner's default cache (20 GB)
    the 8 GB build filled a 62 GB disk. The restart starts from an empty cache either way."""
    return ["--cache-size", "8G"] if keys * p["payload_bytes"] > 4e9 else []


def batches_for(keys: int, events_per_batch: int) -> int:
    """Enough batches for every key to be written once, plus one that updates the state."""
    return -(-keys // events_per_batch) + 1


def metrics_of(setup: dict[str, Any]) -> dict[str, float]:
    first, restart = setup.get("first_run", {}), setup.get("restart", {})
    out = {"restart_s": restart.get("to_first_batch_done_s"), "jvm_s": restart.get("jvm_and_session_s"),
           "first_batch_s": seconds(restart.get("first_batch_ms")), "load_s": seconds(restart.get("rocksdb_load_ms")),
           "download_s": setup.get("download_s"), "records_per_s": first.get("records_per_second"),
           "fetched_first_batch_bytes": restart.get("fetched_before_first_batch_done"),
           # local+download fetches the whole checkpoint before the restart; a mount counts its own
           "fetched_bytes": restart.get("fetched_bytes", setup.get("checkpoint_bytes") if "download_s" in setup
                                        else None)}
    return {k: v for k, v in out.items() if v is not None}


def seconds(ms: Optional[float]) -> Optional[float]:
    return None if ms is None else ms / 1000


def choices(size: str) -> Choices:  # noqa: ARG001 - the same at every size
    """The setups ``--systems`` may name here, and those run without it."""
    return Choices(SETUPS + SHAPED_SETUPS + SHAPED_VARIANTS, SETUPS + SHAPED_SETUPS, GROUPS)


def run(ctx: Context) -> dict[str, Any]:
    p = dict(ctx.pick(SIZES))
    p["keys"] = ctx.state_keys(p["keys"], p["payload_bytes"])  # --state-gb
    p["key_skew"] = ctx.key_skew
    setups = chosen_setups(ctx, SETUPS)
    on_s3, no_s3a = fetch_connector(shaped_setups(ctx))
    variants = [variant_of(k, p["payload_bytes"], ctx.key_skew) for k in p["keys"]]
    env = spark_env(ctx)
    runs: list[dict[str, Any]] = [record(S3A, 0, v, error=no_s3a) for v in variants] if no_s3a else []
    floor_runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        endpoint = stack.enter_context(ShapedMoto(ctx.work / "shaped-s3", ctx.shape)) if on_s3 else None
        for repeat in ctx.repetitions():
            if repeat >= p.get("repeats", ctx.repeats):
                break
            for keys, variant in [(p["floor_keys"], FLOOR), *zip(p["keys"], variants)]:
                call = {"keys": keys, "payload_bytes": p["payload_bytes"], "timeout": p["timeout"],
                        "batches": batches_for(keys, p["events_per_batch"]),
                        "extra": ["--events-per-batch", str(p["events_per_batch"]),
                                  "--restart-events", str(p["restart_events"]), *EXTRA,
                                  *skew_arguments(ctx.key_skew)]}
                label = f"{NAME} r{repeat + 1} {variant}"
                out = floor_runs if variant == FLOOR else runs
                if setups:
                    out += runner_records(ctx, call, setups, env, repeat=repeat, variant=variant, label=label,
                                          metrics_of=metrics_of)
                if endpoint is not None:
                    out += runner_records(ctx, call, on_s3, env, repeat=repeat, variant=variant, label=label,
                                          metrics_of=metrics_of,
                                          runner_args=["--s3-endpoint", endpoint.endpoint, *cache_size(keys, p)])
    names = setups + on_s3 + ([S3A] if no_s3a else [])
    return {"params": {**p, "setups": names, "extra": EXTRA, "shape": ctx.shape.describe() if on_s3 else None},
            "systems": names, "summary": summarize(runs, METRICS, names, variants), "runs": runs,
            "floor": summarize(floor_runs, METRICS, names, [FLOOR]), "floor_runs": floor_runs}


def restart_points(doc: dict[str, Any], system: str, metric: str = "restart_s") -> list[tuple[float, float]]:
    """(GB, median seconds) of one system, smallest state first."""
    return sorted((gigabytes(r["variant"]), r["systems"][system]["median"]) for r in doc.get("summary", [])
                  if r["metric"] == metric and r["systems"].get(system, {}).get("median") is not None)


def line_fit(points: list[tuple[float, float]]) -> Optional[tuple[float, float]]:
    """Least-squares intercept and slope (seconds, seconds per GB), or None under two sizes."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, slope


def size_for_ratio(local: tuple[float, float], fused: tuple[float, float], ratio: float) -> Optional[float]:
    """The state size (GB) where the two fitted lines' ratio reaches ``ratio``, if it ever does."""
    (a1, b1), (a2, b2) = local, fused
    denominator = b1 - ratio * b2
    if denominator <= 0:
        return None
    size = (ratio * a2 - a1) / denominator
    return size if size > 0 else None


def setups_of(doc: dict[str, Any]) -> list[str]:
    """The setups a result holds, in its order (from its rows when it does not list them)."""
    return doc.get("systems") or list(dict.fromkeys(s for r in doc.get("summary", []) for s in r["systems"]))


def size_span(doc: dict[str, Any]) -> float:
    """GB between the smallest and the largest state measured."""
    sizes = {gigabytes(r["variant"]) for r in doc.get("summary", [])}
    return max(sizes) - min(sizes) if sizes else 0.0


def slope_sentence(doc: dict[str, Any]) -> str:
    fits = {s: fit for s in setups_of(doc) if (fit := line_fit(restart_points(doc, s))) is not None}
    if not fits:
        return ""
    if size_span(doc) < MIN_SPAN_GB:
        return (f"The sizes span {size_span(doc):.2g} GB: what that much state adds to a restart is smaller than "
                f"the differences between runs, so no slope per GB is fitted and nothing is extrapolated.")
    sizes = len({x for s in fits for x, _ in restart_points(doc, s)})
    text = (f"Fitted over the medians at {sizes} sizes, the restart takes "
            + "; ".join(f"{a:.1f} s {'+' if b >= 0 else '−'} {abs(b):.1f} s per GB on {s}"
                        for s, (a, b) in fits.items()) + ".")
    for base, mine in [*PAIRS, S3A_PAIR]:
        if base in fits and mine in fits:
            at5 = size_for_ratio(fits[base], fits[mine], 5.0)
            text += (f" Extended in straight lines, {base} and {mine} would be 5× apart at about {at5:,.0f} GB "
                     f"of state." if at5 is not None else
                     f" Extended in straight lines, {base} and {mine} never get 5× apart.")
    return text


def floor_seconds(doc: dict[str, Any]) -> Optional[float]:
    """The fastest median restart over a state of a few megabytes: Spark's own part of a restart."""
    medians = [c["median"] for r in doc.get("floor", []) if r["metric"] == "restart_s"
               for c in r["systems"].values() if c.get("median") is not None]
    return min(medians) if medians else None


def ceiling_sentence(doc: dict[str, Any]) -> str:
    """How far apart any storage could bring a restart and a baseline's, size by size."""
    floor = floor_seconds(doc)
    bases = [(b, pts) for b in (pair[0] for pair in [*PAIRS, S3A_PAIR]) if (pts := restart_points(doc, b))]
    if floor is None or not bases:
        return ""
    p = doc["params"]
    cells = "; ".join(f"{b} " + ", ".join(f"{base / floor:.1f}× at {size:g} GB" for size, base in pts)
                      for b, pts in bases)
    return (f"The floor: with {p['floor_keys'] * p['payload_bytes'] / 1e6:.3g} MB of state and the same batches, "
            f"the restart took {floor:.1f} s (the fastest setup's median). That is Spark's own part of a restart "
            f"(JVM, session, query start, the first batch), which no storage takes away: however fast the "
            f"storage, a restart at S GB is at most baseline(S) / {floor:.1f} s times faster than a baseline's, "
            f"that is, against {cells}.")


def above_floor_table(doc: dict[str, Any]) -> str:
    """Each setup's restart minus the floor (the part above Spark's own), per state size, and its
    fitted slope: what the storage adds to a restart, against state size."""
    floor = floor_seconds(doc)
    names = setups_of(doc)
    if floor is None:
        return ""
    by = {r["variant"]: r for r in doc.get("floor", []) + doc.get("summary", []) if r["metric"] == "restart_s"}
    if len(by) < 2:
        return ""

    def cell(variant: str, s: str) -> str:
        median = by[variant]["systems"].get(s, {}).get("median")
        return "—" if median is None else f"{median - floor:.1f}"

    body = [[variant] + [cell(variant, s) for s in names] for variant in by]
    fitted = size_span(doc) >= MIN_SPAN_GB
    if fitted:
        fits = [line_fit(restart_points(doc, s)) for s in names]
        body.append(["fitted, per GB"] + ["—" if fit is None else f"{fit[1]:.1f}" for fit in fits])
    return (f"Above the floor: each setup's restart minus the floor ({floor:.1f} s), in seconds; the floor row is "
            f"what a setup adds to Spark's own restart when there is almost no state"
            + (", the last row the seconds it adds per GB (the slope fitted over the sizes)" if fitted else "")
            + ".\n\n" + md_table(["state"] + names, body))


def replay_sentence(doc: dict[str, Any]) -> str:
    """What the restarts loaded, from Spark's own RocksDB metrics of the first batch after them."""
    counts, from_snapshot = [], []
    for r in doc.get("runs", []) + doc.get("floor_runs", []):
        rocksdb = r.get("raw", {}).get("restart", {}).get("batch", {}).get("rocksdb", {})
        if "rocksdbNumReplayChangelogFiles" in rocksdb:
            counts.append(rocksdb["rocksdbNumReplayChangelogFiles"])
            from_snapshot.append(rocksdb.get("rocksdbLoadFromSnapshotLatencyMs", 0))
    if not counts or min(counts) == 0 or any(from_snapshot):
        return ""
    return (f"No restart here loaded a snapshot's SST files: none had reached the checkpoint, and every setup "
            f"rebuilt its state stores by replaying the changelogs ({min(counts)}–{max(counts)} files per "
            f"restart); the state store load above is that replay, and the bytes fetched are the changelogs.")


_RESTARTED = "restarted on a fresh cache dir after its daemon was killed"
# What each setup is, in the order the text names them; the last three run on the shaped endpoint.
SETUP_TEXT = {
    "local": "*local*: state and checkpoint on local disk. ",
    "fusestate+shim": f"*fusestate+shim*: a `file://` mount with the `fusestate://` checkpoint, {_RESTARTED}. ",
    S3A: S3A_TEXT,
    "local+download": "*local+download*: the state on local disk, its checkpoint in one of the endpoint's buckets, "
                      "which the fresh node downloads before the query restarts, file by file as Spark's state store "
                      "copies each file (*local+download-parallel*: all files at once, a generous bound); the "
                      "download is part of their restart. ",
    "fusestate+shim@s3": f"*fusestate+shim@s3*: a mount of one of its buckets with the `fusestate://` checkpoint, "
                         f"{_RESTARTED}. ",
}
ON_ENDPOINT_SETUPS = (S3A, "local+download", "fusestate+shim@s3")


def describe_setups(doc: dict[str, Any]) -> str:
    """What each setup of the result is (only those it ran), and the checkpointing it ran with."""
    p = doc["params"]
    present = setups_of(doc)
    text = "".join(t for s, t in SETUP_TEXT.items() if s in present and s not in ON_ENDPOINT_SETUPS)
    if p.get("shape"):
        text += f"On the shaped S3 endpoint ({p['shape']}): " + "".join(
            t for s, t in SETUP_TEXT.items() if s in present and s in ON_ENDPOINT_SETUPS)
    recorded = checkpointing_text(doc)
    if recorded:
        text += recorded[0].upper() + recorded[1:]
    elif "--no-changelog" in p.get("extra", []):
        text += ("Local disk with changelog checkpointing; the fusestate setups with a snapshot on every commit "
                 "(`--no-changelog`). ")
    else:
        text += ("Every setup with changelog checkpointing, a snapshot every "
                 "version with the shim (linked into the checkpoint within a second; the shim setups mount "
                 "with `--prefetch off`), every 10 versions without. ")
    return text


def render(doc: dict[str, Any], img_dir: Path, img_rel: str) -> str:
    p = doc["params"]
    names = doc["systems"]
    sizes = ", ".join(f"{k:,}" for k in p["keys"])
    parts = [f"The pipeline of the `spark` scenario for {sizes} keys × {p['payload_bytes']:,} B "
             f"({keys_text(p.get('key_skew', 0))}), in batches of "
             f"{p['events_per_batch']:,} events (as many as it takes to write every key, plus one); then the job stops "
             f"and restarts from its checkpoint into a {p['restart_events']:,}-event batch. " + describe_setups(doc)
             + f"The page cache is dropped before every restart. Each cell: {' / '.join(names)}. " + medians_note(doc),
             variant_table(doc["summary"] + [r for r in doc.get("floor", []) if r["metric"] in FLOOR_METRICS],
                           names, [m.name for m in METRICS], "state")]
    for text in (above_floor_table(doc), " ".join(s for s in (replay_sentence(doc), slope_sentence(doc),
                                                             ceiling_sentence(doc)) if s)):
        if text:
            parts.append(text)
    table = breakdown_table(doc)
    if table:
        parts.append(table)
    series = {**{system: restart_points(doc, system) for system in names},
              **{f"{system} load": restart_points(doc, system, "load_s") for system in names if system in SETUPS}}
    plot = points_plot(img_dir / "spark-restart-size.png", series, img_rel, "spark restart against state size",
                       xlabel="state size (GB)", ylabel="seconds",
                       title="Spark: restart to the first batch, and the state load, against state size")
    if plot:
        parts.append(plot)
    return "\n\n".join(parts)


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def breakdown_table(doc: dict[str, Any]) -> str:
    """What the restarted query read, by purpose, and what the node fetched (the ``:trace``
    setup's first repetition at each size; bench/read_breakdown.py), in MB: before its first
    batch began / while the batch ran, and the distinct bytes read."""
    found = {r["variant"]: r["raw"]["restart"]["breakdown"] for r in doc.get("runs", [])
             if r["system"].endswith(":trace") and r.get("raw") and r["repeat"] == 0
             and r["raw"].get("restart", {}).get("breakdown")}
    if not found:
        return ""
    sizes = list(found)
    rows = []
    for key, label in PURPOSES.items():
        rows.append([label] + [f"{_mb(b['reads'][key]['before_batch']['bytes'])} / "
                               f"{_mb(b['reads'][key]['batch']['bytes'])} ({_mb(b['distinct_bytes'][key])} distinct)"
                               for b in found.values()])
    for part, label in (("whole_blocks", "fetched: whole blocks"), ("ranges", "fetched: range reads")):
        rows.append([label] + [f"{_mb(b['fetched']['before_batch'][part])} / {_mb(b['fetched']['batch'][part])}"
                               for b in found.values()])
    rows.append(["tables read: count, data blocks / tails (MB)"]
                + [f"{b['tables_read']:,}: {_mb(b['tables_data_bytes'])} / {_mb(b['tables_tail_bytes'])}"
                   for b in found.values()])
    rows.append(["first batch (s)"] + [f"{b['batch_s']:.1f}" for b in found.values()])
    return ("What the restarted query read, by purpose (`fusestate+shim@s3:trace`: no page fill, every read "
            "that reached the daemon recorded; a page is read once, as the page cache keeps it), in MB: before "
            "its first batch began / while it ran (distinct bytes), and what the node fetched from the bucket.\n\n"
            + md_table(["read", *sizes], rows))


def goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The restart goal of the Spark issue at the largest state this scenario measured: fusestate+shim
    against local disk, and on the shaped endpoint fusestate+shim@s3 against local+download."""
    out = []
    floor = floor_seconds(doc)
    for base_name, name in PAIRS:
        base_pts, mine_pts = restart_points(doc, base_name), restart_points(doc, name)
        if not base_pts or not mine_pts or base_pts[-1][0] != mine_pts[-1][0]:
            continue
        (size, base), (_, mine) = base_pts[-1], mine_pts[-1]
        ceiling = f"; at most {base / floor:.1f}× over a {floor:.1f} s floor" if floor else ""
        baseline = ("local (changelog)" if base_name == "local" else
                    f"{base_name} (its checkpoint downloaded file by file first)")
        out.append(goal_row(f"Spark pipeline, restart to the first completed batch at {size:g} GB, fixed batch "
                            f"size, {baseline} / {name} on a fresh cache dir ≥ 5",
                            f"{base / mine:.2f}× ({mine:.1f} s against {base:.1f} s{ceiling})", base / mine >= 5))
    out += recovery_goals(doc)
    base_pts, mine_pts = (dict(restart_points(doc, n)) for n in S3A_PAIR)
    if set(base_pts) & set(mine_pts) and not doc.get("params", {}).get("key_skew"):
        out.append(ratio_goal(f"Spark pipeline, restart to the first completed batch on a fresh node, "
                              f"{S3A_PAIR[1]} / {S3A_PAIR[0]}", mine_pts, base_pts, S3A_GOAL))
    return out


def ratio_goal(goal: str, mine: dict[float, float], base: dict[float, float], at_most: float) -> dict[str, Any]:
    """A goal on restart seconds against a baseline's, at every size both ran (GB -> seconds)."""
    ratios = {size: mine[size] / base[size] for size in sorted(set(mine) & set(base))}
    return goal_row(f"{goal} ≤ {at_most:g} at every size",
                    "; ".join(f"{r:.2f} at {size:g} GB ({mine[size]:.1f} s against {base[size]:.1f} s)"
                              for size, r in ratios.items()),
                    all(r <= at_most for r in ratios.values()))


LAZY = "fusestate+shim@s3"
NO_CHANGELOG, CHANGELOG, SAME_NODE = "no-changelog", "changelog", "same-node"
SKEWED_S3A_GOAL, SKEWED_FLOOR_GOAL, SKEWED_FETCH_GOAL, SAME_NODE_FETCH_GOAL = 0.3, 1.3, 0.25, 0.01


def recovery_goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The goals of a restart that does not wait for the state: on skewed keys against s3a and
    the floor, and what the restart fetched before its first batch was done, for the default
    setup and, when they ran, the ones with changelog checkpointing on or off; a restart on the same node
    (``:same-node``, with any other variant) fetching next to nothing."""
    out = []
    skew = doc.get("params", {}).get("key_skew") or 0
    s3a = dict(restart_points(doc, S3A))
    floor = floor_seconds(doc)
    for name in (LAZY, f"{LAZY}:{NO_CHANGELOG}", f"{LAZY}:{CHANGELOG}"):
        lazy = dict(restart_points(doc, name))
        fetched = dict(restart_points(doc, name, "fetched_first_batch_bytes"))
        if skew and set(s3a) & set(lazy):
            out.append(ratio_goal(f"Spark restart on a fresh node, Zipf keys (s = {skew:g}), {name} / {S3A}",
                                  lazy, s3a, SKEWED_S3A_GOAL))
        if skew and lazy and floor:
            size, took = max(lazy.items())
            out.append(goal_row(f"Spark restart on a fresh node, Zipf keys, {name} at the largest state ({size:g} GB) "
                                f"/ the floor ≤ {SKEWED_FLOOR_GOAL:g}",
                                f"{took / floor:.2f} ({took:.1f} s against {floor:.1f} s)",
                                took / floor <= SKEWED_FLOOR_GOAL))
        if skew and fetched:
            out.append(share_goal(f"Spark restart, Zipf keys, {name}, bytes fetched before the first batch was "
                                  "done / the state", fetched, SKEWED_FETCH_GOAL, 2))
    for name in doc.get("systems", []):
        if name.startswith(f"{LAZY}:") and SAME_NODE in name.partition(":")[2].split("+"):
            same = dict(restart_points(doc, name, "fetched_bytes"))
            if same:
                out.append(share_goal(f"Spark restart on the same node (its cache dir kept, {name}), bytes "
                                      "fetched / the state", same, SAME_NODE_FETCH_GOAL, 4))
    return out


def share_goal(goal: str, fetched: dict[float, float], at_most: float, digits: int) -> dict[str, Any]:
    """A goal on bytes fetched as a share of the state, at each size (GB -> bytes)."""
    shares = {size: b / (size * 1e9) for size, b in fetched.items()}
    return goal_row(f"{goal} ≤ {at_most:g}", "; ".join(f"{r:.{digits}f} at {size:g} GB" for size, r in shares.items()),
                    all(r <= at_most for r in shares.values()))
