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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from bench.common import Context, Metric, summarize
from bench.render import goal_row, medians_note, points_plot, variant_table
from bench.scenarios.spark import chosen_setups, runner_records, spark_env

NAME = "spark-restart"
FLOOR = "floor"
TITLE = "Spark restart against state size"
SUMMARY = "Spark pipeline: restart to the first completed batch for growing state, fixed batch size"
BUDGET = {"tiny": None, "quick": 300.0, "full": None}
SETUPS = ["local", "fusestate+shim"]
EXTRA = ["--state-compression", "none", "--no-changelog"]
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
    Metric("load_s", "s", higher_is_better=False, label="state store load (sum over stores)"),
    Metric("fetched_bytes", "B", higher_is_better=False, label="bytes fetched by the restart"),
    Metric("records_per_s", "records/s", label="records/s while building the state"),
]


def variant_of(keys: int, payload: int) -> str:
    """The state size as a label that keeps small sizes apart: '0.512 GB', '4.1 GB'."""
    return f"{keys * payload / 1e9:.3g} GB"


def gigabytes(variant: str) -> float:
    return float(variant.split()[0])


def batches_for(keys: int, events_per_batch: int) -> int:
    """Enough batches for every key to be written once, plus one that updates the state."""
    return -(-keys // events_per_batch) + 1


def metrics_of(setup: dict[str, Any]) -> dict[str, float]:
    first, restart = setup.get("first_run", {}), setup.get("restart", {})
    out = {"restart_s": restart.get("to_first_batch_done_s"), "jvm_s": restart.get("jvm_and_session_s"),
           "first_batch_s": seconds(restart.get("first_batch_ms")), "load_s": seconds(restart.get("rocksdb_load_ms")),
           "fetched_bytes": restart.get("fetched_bytes"), "records_per_s": first.get("records_per_second")}
    return {k: v for k, v in out.items() if v is not None}


def seconds(ms: Optional[float]) -> Optional[float]:
    return None if ms is None else ms / 1000


def run(ctx: Context) -> dict[str, Any]:
    p = dict(ctx.pick(SIZES))
    setups = chosen_setups(ctx, SETUPS)
    variants = [variant_of(k, p["payload_bytes"]) for k in p["keys"]]
    env = spark_env(ctx)
    runs: list[dict[str, Any]] = []
    floor_runs: list[dict[str, Any]] = []
    for repeat in ctx.repetitions():
        if repeat >= p.get("repeats", ctx.repeats):
            break
        for keys, variant in [(p["floor_keys"], FLOOR), *zip(p["keys"], variants)]:
            call = {"keys": keys, "payload_bytes": p["payload_bytes"], "timeout": p["timeout"],
                    "batches": batches_for(keys, p["events_per_batch"]),
                    "extra": ["--events-per-batch", str(p["events_per_batch"]),
                              "--restart-events", str(p["restart_events"]), *EXTRA]}
            (floor_runs if variant == FLOOR else runs).extend(
                runner_records(ctx, call, setups, env, repeat=repeat, variant=variant,
                                    label=f"{NAME} r{repeat + 1} {variant}", metrics_of=metrics_of))
    return {"params": {**p, "setups": setups, "extra": EXTRA}, "systems": setups,
            "summary": summarize(runs, METRICS, setups, variants), "runs": runs,
            "floor": summarize(floor_runs, METRICS, setups, [FLOOR]), "floor_runs": floor_runs}


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


def slope_sentence(doc: dict[str, Any]) -> str:
    local, fused = (line_fit(restart_points(doc, s)) for s in ("local", "fusestate+shim"))
    if local is None or fused is None:
        return ""
    text = (f"Fitted over the medians, the restart takes {local[0]:.1f} s + {local[1]:.1f} s per GB on local "
            f"disk and {fused[0]:.1f} s + {fused[1]:.1f} s per GB on fusestate+shim.")
    at5 = size_for_ratio(local, fused, 5.0)
    if at5 is not None:
        text += f" Extended in straight lines, the two would be 5× apart at about {at5:,.0f} GB of state."
    else:
        text += " Extended in straight lines, they never get 5× apart."
    return text


def floor_seconds(doc: dict[str, Any]) -> Optional[float]:
    """The fastest median restart over a state of a few megabytes: Spark's own part of a restart."""
    medians = [c["median"] for r in doc.get("floor", []) if r["metric"] == "restart_s"
               for c in r["systems"].values() if c.get("median") is not None]
    return min(medians) if medians else None


def ceiling_sentence(doc: dict[str, Any]) -> str:
    """How far apart any storage could bring the two restarts, size by size."""
    floor = floor_seconds(doc)
    local = restart_points(doc, "local")
    if floor is None or not local:
        return ""
    p = doc["params"]
    cells = ", ".join(f"{base / floor:.1f}× at {size:g} GB" for size, base in local)
    return (f"The floor: with {p['floor_keys'] * p['payload_bytes'] / 1e6:.3g} MB of state and the same batches, "
            f"the restart took {floor:.1f} s (the faster setup's median). That is Spark's own part of a restart "
            f"(JVM, session, query start, the first batch), which no storage takes away: however fast the "
            f"storage, a restart at S GB is at most local(S) / {floor:.1f} s times faster than local disk's, "
            f"that is {cells}.")


def render(doc: dict[str, Any], img_dir: Path, img_rel: str) -> str:
    p = doc["params"]
    sizes = ", ".join(f"{k:,}" for k in p["keys"])
    parts = [f"The pipeline of the `spark` scenario for {sizes} keys × {p['payload_bytes']:,} B, in batches of "
             f"{p['events_per_batch']:,} events (as many as it takes to write every key, plus one); then the job stops "
             f"and restarts from its checkpoint into a {p['restart_events']:,}-event batch. *local*: state and "
             f"checkpoint on local disk, changelog checkpointing; *fusestate+shim*: a `file://` mount with the "
             f"`fusestate://` checkpoint, a snapshot on every commit, restarted on a fresh cache dir after its daemon "
             f"was killed. The page cache is dropped before every restart. Each cell: "
             f"{' / '.join(doc['systems'])}. " + medians_note(doc),
             variant_table(doc["summary"] + [r for r in doc.get("floor", []) if r["metric"] in FLOOR_METRICS],
                           doc["systems"], [m.name for m in METRICS], "state")]
    sentences = " ".join(s for s in (slope_sentence(doc), ceiling_sentence(doc)) if s)
    if sentences:
        parts.append(sentences)
    series = {**{system: restart_points(doc, system) for system in doc["systems"]},
              **{f"{system} load": restart_points(doc, system, "load_s") for system in doc["systems"]}}
    plot = points_plot(img_dir / "spark-restart-size.png", series, img_rel, "spark restart against state size",
                       xlabel="state size (GB)", ylabel="seconds",
                       title="Spark: restart to the first batch, and the state load, against state size")
    if plot:
        parts.append(plot)
    return "\n\n".join(parts)


def goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The restart goal of the Spark issue, at the largest state this scenario measured."""
    local, fused = restart_points(doc, "local"), restart_points(doc, "fusestate+shim")
    if not local or not fused or local[-1][0] != fused[-1][0]:
        return []
    (size, base), (_, mine) = local[-1], fused[-1]
    floor = floor_seconds(doc)
    ceiling = f"; at most {base / floor:.1f}× over a {floor:.1f} s floor" if floor else ""
    return [goal_row(f"Spark pipeline, restart to the first completed batch at {size:g} GB, fixed batch size, "
                     f"local (changelog) / fusestate+shim on a fresh cache dir ≥ 5",
                     f"{base / mine:.2f}× ({mine:.1f} s against {base:.1f} s{ceiling})", base / mine >= 5)]
