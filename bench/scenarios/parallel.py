"""Scenario 10: many nodes at once on one shared volume, fusestate against JuiceFS.

A cluster of many executors presses a shared volume's metadata server from every node at
once. Here ``nodes`` mounts of one volume (``fusestate-pg``'s, then ``juicefs-pg``'s: each
mount its own mountpoint and cache dir, the same bucket and metadata, as a node mounts it;
one PostgreSQL server for both) each get a worker process, and all of them, released
together, run one phase at a time:

- *create*: new files of 4 KiB, each written and closed (as in ``files``);
- *stat*: the files every other node made, through the worker's own mount (never looked up
  there before, so no kernel cache answers);
- *rename*: the worker's own files, to a new name in the same directory.

Once with every node's files in one directory (every change updates that directory), once
with each node's in a directory of its own. Measured per phase: the aggregate rate (all
operations over the time from the common start to the last worker's end; each worker stops
after ``phase_seconds``), the PostgreSQL server's CPU per operation (its processes' time
from ``/proc``, :func:`bench.pgwork.server_cpu_seconds`), the mounts' CPU per operation, and
the server's transactions and WAL records per operation (:mod:`bench.pgwork`).

Real mounts, not the engine driven from processes: the daemons' own work (a FUSE request,
its Python, its round trips) is part of what a node pays, and 8 mounts of each system fit
on this 2-core machine (mounted for their system's turn only, then unmounted).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
from pathlib import Path
from typing import Any, Optional

from bench.common import Choices, Context, Metric, error_text, fmt_num, log, record, summarize, text_grid
from bench.pgwork import FLUSH_WAIT, Meter, postmaster_pid
from bench.render import goal_row, md_table, ratio_between
from bench.systems import System, detach_all_under, make_system, postgres_if_needed

NAME = "parallel"
TITLE = "Many nodes at once"
SUMMARY = "8 mounts of one shared volume create, stat, rename at once: ops/s, PostgreSQL CPU per op, vs JuiceFS"
BUDGET = {"tiny": None, "quick": 600.0, "full": None}
SYSTEMS = ["fusestate-pg", "juicefs-pg"]
OURS, THEIRS = SYSTEMS
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"nodes": 2, "files_per_node": 20, "phase_seconds": 10.0, "pg_wait": None},
    "quick": {"nodes": 8, "files_per_node": 150, "phase_seconds": 10.0, "pg_wait": FLUSH_WAIT},
    "full": {"nodes": 8, "files_per_node": 1000, "phase_seconds": 30.0, "pg_wait": FLUSH_WAIT},
}
LAYOUTS = ("one directory", "own directories")
OPS = ("create", "stat", "rename")
METRICS = [
    Metric("create", "ops/s", label="create 4 KiB file"),
    Metric("stat", "ops/s", label="stat a file another node made"),
    Metric("rename", "ops/s", label="rename in the directory"),
]
COSTS = [
    Metric("pg_cpu_ms", "ms", higher_is_better=False, label="PostgreSQL CPU"),
    Metric("cpu_ms", "ms", higher_is_better=False, label="mounts' CPU"),
    Metric("pg_xacts", "/op", higher_is_better=False, label="transactions"),
    Metric("pg_wal_records", "/op", higher_is_better=False, label="WAL records"),
]
START_TIMEOUT = 120.0  # s for the workers to start and reach the common start


# --- the workers (one process per mount) ---------------------------------------------------
def _work(op: str, items: list[Any], limit: float, barrier: Any, results: Any, index: int) -> None:
    """One node's part of a phase: released with the others, until its items are done or
    ``limit`` seconds have passed; reports (index, done, start, end, error)."""
    def create(path: str) -> None:
        with open(path, "wb") as f:
            f.write(os.urandom(4096))

    def rename(pair: list[str]) -> None:
        os.rename(pair[0], pair[1])

    do = {"create": create, "stat": os.stat, "rename": rename}[op]
    done, error = 0, None
    barrier.wait(START_TIMEOUT)
    start = time.monotonic()
    try:
        for item in items:
            do(item)
            done += 1
            if time.monotonic() - start > limit:
                break
    except OSError as exc:
        error = f"{op} {exc.filename}: {exc.strerror}"
    results.put((index, done, start, time.monotonic(), error))


def run_phase(op: str, work: list[list[Any]], limit: float) -> dict[str, Any]:
    """Every node's worker released at once: operations done per node, the aggregate rate and
    the first error."""
    mp = multiprocessing.get_context("fork")  # the workers start at once, with nothing to import
    barrier, results = mp.Barrier(len(work) + 1), mp.Queue()
    procs = [mp.Process(target=_work, args=(op, items, limit, barrier, results, i), daemon=True)
             for i, items in enumerate(work)]
    for p in procs:
        p.start()
    try:
        barrier.wait(START_TIMEOUT)
        got = []
        for _ in procs:
            got.append(results.get(timeout=limit + START_TIMEOUT))
    except (queue.Empty, Exception) as exc:  # noqa: BLE001 - a stuck worker is this phase's failure
        raise RuntimeError(f"{op}: the workers did not finish ({type(exc).__name__})") from None
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    got.sort()
    done = [g[1] for g in got]
    wall = max(g[3] for g in got) - min(g[2] for g in got)
    errors = [g[4] for g in got if g[4]]
    return {"done": done, "rate": sum(done) / wall if wall > 0 else 0.0, "seconds": wall,
            "error": errors[0] if errors else None}


# --- one system's turn ---------------------------------------------------------------------
def layout_paths(mounts: list[Path], base: str, layout: str, n: int) -> list[list[str]]:
    """Each node's files, as its own mount names them: all in ``base/all`` or each node's in
    ``base/n<i>``."""
    if layout == LAYOUTS[0]:
        return [[str(m / base / "all" / f"n{i}-{k:05d}") for k in range(n)] for i, m in enumerate(mounts)]
    return [[str(m / base / f"n{i}" / f"f{k:05d}") for k in range(n)] for i, m in enumerate(mounts)]


def mount_nodes(primary: System, count: int, nodes: list[System]) -> None:
    """The volume's first mount and ``count - 1`` more, as other nodes mount it, into ``nodes``
    as each is made (so that a failure leaves the ones to unmount there)."""
    nodes.append(primary)
    primary.start()
    for i in range(1, count):
        twin = primary.twin(f"node-{i + 1}")
        if twin is None:
            raise RuntimeError(f"{primary.name} takes one mount at a time")
        nodes.append(twin)
        twin.start()


def unmount_nodes(nodes: list[System]) -> None:
    for node in reversed(nodes):
        try:
            node.stop()
        except Exception as exc:  # noqa: BLE001 - keep stopping the others
            log(f"  {node.name}: stop failed: {exc}")
        finally:
            if node is not nodes[0]:
                node.close()


def one_layout(nodes: list[System], layout: str, base: str, p: dict[str, Any],
               meter: Meter) -> tuple[dict[str, float], dict[str, dict[str, float]], list[str]]:
    """The three phases in one layout: rates, costs per operation, errors."""
    mounts = [n.path for n in nodes]
    paths = layout_paths(mounts, base, layout, p["files_per_node"])
    for i, mine in enumerate(paths):  # not timed: each node makes its directory through its own mount
        os.makedirs(os.path.dirname(mine[0]), exist_ok=True)
    rates: dict[str, float] = {}
    errors: list[str] = []
    limit = p["phase_seconds"]
    with meter.phase("create") as ph:
        out = run_phase("create", paths, limit)
        ph.ops = sum(out["done"])
    rates["create"], made = out["rate"], [mine[:d] for mine, d in zip(paths, out["done"])]
    errors += [f"create: {out['error']}"] if out["error"] else []
    # Node i stats what every other node made (node i+1's first), through its own mount.
    count = len(nodes)
    theirs = [[str(mounts[i] / Path(f).relative_to(mounts[j])) for j in [(i + k) % count for k in range(1, count)]
               for f in made[j]] for i in range(count)]
    with meter.phase("stat") as ph:
        out = run_phase("stat", theirs, limit)
        ph.ops = sum(out["done"])
    rates["stat"] = out["rate"]
    errors += [f"stat: {out['error']}"] if out["error"] else []
    with meter.phase("rename") as ph:
        out = run_phase("rename", [[[f, f + ".r"] for f in mine] for mine in made], limit)
        ph.ops = sum(out["done"])
    rates["rename"] = out["rate"]
    errors += [f"rename: {out['error']}"] if out["error"] else []
    return rates, dict(meter.costs), errors


def one(primary: System, repeat: int, p: dict[str, Any]) -> list[dict[str, Any]]:
    """One system's turn: mount the nodes, both layouts, unmount. A record per layout (rates)
    and per layout and phase (costs)."""
    if primary.error:
        return [record(primary.name, repeat, layout, error=primary.error) for layout in LAYOUTS]
    out: list[dict[str, Any]] = []
    nodes: list[System] = []
    try:
        mount_nodes(primary, p["nodes"], nodes)
        server = getattr(primary, "server", None)
        db = primary.database() if p["pg_wait"] is not None else None
        for layout in LAYOUTS:
            meter = Meter([n.daemon_pid() for n in nodes], db, p["pg_wait"] or 0.0,
                          server=postmaster_pid(server.data) if server is not None else None)
            base = f"parallel-r{repeat}-{'shared' if layout == LAYOUTS[0] else 'own'}"
            try:
                rates, costs, errors = one_layout(nodes, layout, base, p, meter)
            except Exception as exc:  # noqa: BLE001 - a failed layout is a result
                rates, costs, errors = {}, {}, [error_text(exc)]
            error = "; ".join(errors) or None
            log(f"  {NAME} r{repeat + 1} {primary.name:<13} {layout:<16} "
                + " ".join(f"{k}={v:,.0f}/s" for k, v in rates.items())
                + "".join(f" {op}:pg_cpu={c['pg_cpu_ms']:.2f}ms" for op, c in costs.items() if "pg_cpu_ms" in c)
                + (f"  ERROR {error}" if error else ""))
            out.append(record(primary.name, repeat, layout, rates, error=error))
            out += [record(primary.name, repeat, f"{layout}: {op}", {k: v for k, v in c.items() if k != "ops"},
                           kind="cost", ops=c.get("ops")) for op, c in costs.items() if c.get("ops")]
    except Exception as exc:  # noqa: BLE001 - the nodes could not mount: every cell gets why
        log(f"  {NAME} r{repeat + 1} {primary.name}: ERROR {error_text(exc)}")
        out = [record(primary.name, repeat, layout, error=error_text(exc)) for layout in LAYOUTS]
    finally:
        unmount_nodes(nodes)
    return out


def choices(size: str) -> Choices:  # noqa: ARG001 - the same at every size
    """The systems ``--systems`` may name here, and those run without it."""
    return Choices(SYSTEMS, SYSTEMS)


def run(ctx: Context) -> dict[str, Any]:
    p = dict(ctx.pick(SIZES))
    names = ctx.chosen(choices(ctx.size))
    if ctx.mount_options:
        log(f"  {NAME}: fusestate mounts with --mount-options {' '.join(ctx.mount_options)}")
    runs: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    ctx.work.mkdir(parents=True, exist_ok=True)
    with postgres_if_needed(names) as server:
        volumes: dict[str, System] = {}
        for name in names:
            try:
                volumes[name] = make_system(name, ctx.work, None, postgres=server,
                                            fusestate_extra=ctx.mount_options)
            except Exception as exc:  # noqa: BLE001 - a system that cannot exist is a result
                volumes[name] = System(name, ctx.work / name)
                volumes[name].error = error_text(exc)
        try:
            for repeat in ctx.repetitions():
                for name in names:
                    runs += one(volumes[name], repeat, p)
            info = {n: v.info() for n, v in volumes.items()}
        finally:
            for v in volumes.values():
                v.close()
            detach_all_under(ctx.work)
    rates = [r for r in runs if r.get("kind") != "cost"]
    costs = [r for r in runs if r.get("kind") == "cost"]
    variants = [f"{layout}: {op}" for layout in LAYOUTS for op in OPS]
    return {"params": p, "systems": names, "system_info": info,
            "summary": summarize(rates, METRICS, names, list(LAYOUTS), baseline=THEIRS),
            "costs": summarize(costs, COSTS, names, variants, baseline=THEIRS), "runs": runs}


# --- tables --------------------------------------------------------------------------------
def table(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One line per layout and operation: each system's aggregate rate, ours over theirs, and
    each system's costs per operation ("ours / theirs")."""
    names = doc["systems"]
    rates = {(r["variant"], r["metric"]): r for r in doc["summary"]}
    costs = {(r["variant"], r["metric"]): r for r in doc.get("costs", [])}
    both = len(names) == 2
    head = ["layout", "operation", *[f"{n} (ops/s)" for n in names]] + (["ratio"] if both else [])
    head += [f"{m.label} per op ({m.unit if m.unit != '/op' else 'count'})" for m in COSTS]
    body = []
    for layout in LAYOUTS:
        for op in OPS:
            row = rates.get((layout, op))
            if row is None:
                continue
            line = [layout, op] + [_cell(row, n) for n in names]
            if both:
                ratio = ratio_between(row, *names)
                line.append(f"{ratio:.2f}" if ratio is not None else "—")
            for m in COSTS:
                c = costs.get((f"{layout}: {op}", m.name))
                line.append(" / ".join(_cell(c, n) for n in names) if c else "—")
            body.append(line)
    return head, body


def _cell(row: dict[str, Any], name: str) -> str:
    cell = row["systems"].get(name)
    if cell is None:
        return "—"
    return "failed" if cell["median"] is None else fmt_num(cell["median"], row["unit"])


def terminal(doc: dict[str, Any]) -> str:
    names = " / ".join(doc["systems"])
    return (f"{doc['params']['nodes']} mounts of one volume at once; costs per operation {names}\n"
            + text_grid(*table(doc)))


def render(doc: dict[str, Any], img_dir: Path, img_rel: str) -> str:  # noqa: ARG001 - no plot
    p = doc["params"]
    text = (f"{p['nodes']} mounts of one volume (`fusestate-pg`'s, then `juicefs-pg`'s; each its own mountpoint "
            f"and cache dir, the same `file://` bucket and metadata; one PostgreSQL server with `fsync` on), a "
            f"worker process each, all released at once for each phase: *create* up to {p['files_per_node']:,} "
            f"files of 4 KiB per node (written and closed), *stat* the files every other node made (through the "
            f"worker's own mount, where they were never looked up), *rename* the node's own files in their "
            f"directory; each worker stops after {p['phase_seconds']:g} s. Once with every node's files in one "
            f"directory, once with each node's in its own. Rates are all operations over the time from the "
            f"common start to the last worker's end; the ratio is {OURS} over {THEIRS}. Per operation, "
            f"{OURS} / {THEIRS}: the PostgreSQL server's CPU (its processes' time in `/proc`), the mounts' CPU "
            f"(all {p['nodes']}), and the server's transactions (of the volume's database) and WAL records, read "
            f"{p.get('pg_wait') or 0:g} s after each phase. Median of {_repeats(doc)} repetition(s).")
    return "\n\n".join([text, md_table(*table(doc))])


def _repeats(doc: dict[str, Any]) -> int:
    return doc.get("repeats") or len({r.get("repeat") for r in doc.get("runs", [])})


def goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 46's namespace goal (create, stat, rename: fusestate-pg / juicefs-pg ≥ 1.5), read at
    many nodes at once."""
    if set(SYSTEMS) - set(doc.get("systems", [])):
        return []
    out = []
    for r in doc.get("summary", []):
        ratio = ratio_between(r, OURS, THEIRS)
        out.append(goal_row(f"{r['metric']} with {doc['params']['nodes']} nodes, {r['variant']}, {OURS} / {THEIRS} "
                            f"≥ 1.5", f"{ratio:.2f}" if ratio is not None else "no number",
                            ratio is not None and ratio >= 1.5))
    return out
