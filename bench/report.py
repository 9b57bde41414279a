"""Fill the generated blocks of docs/benchmarks.md from the newest result of each scenario.

docs/benchmarks.md is written by hand; each scenario's numbers sit in a block between
``<!-- bench: NAME -->`` and ``<!-- /bench: NAME -->``, regenerated from the newest JSON of
that scenario, so the tables always match committed data while the prose around them (how
to read them, what limits the gap) stays as written. The JSON files are copied to
docs/bench-data/ (older ones of the same scenario removed), and ``bench/run --report-only``
regenerates every block from there. A scenario with a result but no block gets a new
section at the end; a block whose scenario has no result is left as it is.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

from bench import machine
from bench.common import DATA_DIR, FORMAT, ROOT, load_results, repetitions
from bench.scenarios import SCENARIOS

DOC = ROOT / "docs" / "benchmarks.md"
IMG_DIR = ROOT / "docs" / "img" / "bench"
SKELETON = "# Benchmarks\n\nHow to run these: [bench/README.md](../bench/README.md).\n"
MET = {True: "met", False: "**not met**", None: "—"}


def block_pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"<!-- bench: {re.escape(name)} -->\n.*?<!-- /bench: {re.escape(name)} -->", re.S)


def publish(found: dict[str, tuple[Path, dict[str, Any]]], data_dir: Path) -> None:
    """Copy the results a report is made from to ``data_dir``, replacing older ones of the same scenario."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, (path, _) in found.items():
        for old in data_dir.glob("*.json"):
            try:
                doc = json.loads(old.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(doc, dict) and doc.get("format") == FORMAT and doc.get("scenario") == name:
                old.unlink()
        shutil.copy2(path, data_dir / path.name)


def generate(source: Path, *, copy_to: Optional[Path] = DATA_DIR, only: Optional[list[str]] = None,
             out_md: Path = DOC, img_dir: Path = IMG_DIR) -> Path:
    """Rewrite the blocks of ``out_md`` (and the plots under ``img_dir``) from the newest result per scenario."""
    found = load_results(source)
    if only:
        found = {k: v for k, v in found.items() if k in only}
    if copy_to is not None and copy_to.resolve() != source.resolve():
        publish(found, copy_to)
        found = {k: v for k, v in load_results(copy_to).items() if not only or k in only}
    img_dir.mkdir(parents=True, exist_ok=True)
    if not only:  # every block is made again: no plot of an old block stays behind
        for old in img_dir.glob("*.png"):
            old.unlink()
    img_rel = os.path.relpath(img_dir, out_md.parent)
    data_rel = os.path.relpath(copy_to or source, out_md.parent)
    text = out_md.read_text() if out_md.exists() else SKELETON
    for name in [n for n in SCENARIOS if n in found]:
        path, doc = found[name]
        block = render_block(name, path, doc, img_dir, img_rel, data_rel)
        pattern = block_pattern(name)
        if pattern.search(text):
            text = pattern.sub(lambda _: block, text, count=1)
        else:
            text = text.rstrip("\n") + f"\n\n## {SCENARIOS[name].TITLE}\n{block}\n"
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(text)
    return out_md


def render_block(name: str, path: Path, doc: dict[str, Any], img_dir: Path, img_rel: str, data_rel: str) -> str:
    """One scenario's generated block: the run and the method (one paragraph), the table, plots,
    then failures and goals (one paragraph)."""
    mod = SCENARIOS[name]
    meta = f"*{run_line(name, doc)}; data: [{path.name}]({data_rel}/{path.name}).*"
    if doc.get("error"):
        body = f"The scenario failed: `{doc['error']}`"
    else:
        try:
            tail = "\n".join(t for t in (failures(doc), goals_list(mod.goals(doc))) if t)
            body = mod.render(doc, img_dir, img_rel) + (f"\n\n{tail}" if tail else "")
        except Exception as exc:  # noqa: BLE001 - one broken block must not lose the report
            body = f"Rendering this block failed: `{type(exc).__name__}: {exc}`"
    return f"<!-- bench: {name} -->\n{meta}\n{body}\n<!-- /bench: {name} -->"


def run_line(name: str, doc: dict[str, Any]) -> str:
    """Which run the numbers are from: the command, repetitions, date, revision and machine."""
    m = doc.get("machine", {})
    rev, _, dirty = m.get("versions", {}).get("fusestate_git", "?").partition("+")
    size = {"quick": " --quick", "tiny": " --tiny"}.get(doc.get("size", ""), "")
    options = f" --mount-options '{' '.join(doc['mount_options'])}'" if doc.get("mount_options") else ""
    return (f"`bench/run{size} --scenario {name}{options}`: {repetitions(doc)} repetition(s) on "
            f"{str(doc.get('started', '?')).replace('T', ' ')[:16]}, {doc.get('duration_seconds', 0) / 60:.1f} min, "
            f"fusestate {rev[:7]}{'+' + dirty if dirty else ''}, {machine.summary_line(m)}")


def goals_list(goals: list[dict[str, Any]]) -> str:
    """The goals the scenario measures, in one paragraph."""
    if not goals:
        return ""
    return "**Goals.** " + "; ".join(f"{g['goal']}: {g['measured']}, {MET[g['met']]}" for g in goals) + "."


def failures(doc: dict[str, Any]) -> str:
    """Every distinct failure of a scenario, once, with how many runs it stopped (logs are in the JSON)."""
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for r in doc.get("runs", []):
        err = r.get("error")
        if not err or err.startswith("skipped: "):
            continue
        key = (r["system"], err.split(": ", 1)[0] + ": " + _strip_paths(err))
        entry = seen.setdefault(key, {"count": 0, "variant": r.get("variant"), "error": err})
        entry["count"] += 1
    if not seen:
        return ""
    cells = [f"{system}{', ' + e['variant'] if e['variant'] else ''} ({e['count']}×): `{e['error'][:200]}`"
             for (system, _), e in seen.items()]
    return "**Failed runs** (a failure is a result: the run stopped there): " + "; ".join(cells) + "."


def _strip_paths(text: str) -> str:
    """An error without offsets and paths, so that the same failure on other files counts once."""
    return re.sub(r"(/[\w.+-]+)+|offset \d+|\d+", "#", text)[:120]
