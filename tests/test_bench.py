"""The benchmark harness (bench/): its CLI, its report, and one tiny scenario end to end."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, is_mounted

from bench import report
from bench.common import FORMAT, Metric, load_results, record, summarize

RUN = ROOT / "bench" / "run"


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


def test_report_renders_ratio_table_and_plots(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "rocksdb-old.json").write_text(json.dumps(fixture_doc("rocksdb", "2026-01-01T00:00:00", 1.0)))
    (data / "rocksdb-new.json").write_text(json.dumps(fixture_doc("rocksdb", "2026-01-02T00:00:00")))
    (data / "unrelated.json").write_text(json.dumps({"results": []}))  # another script's output: skipped
    assert set(load_results(data)) == {"rocksdb"}
    out, img = tmp_path / "docs" / "benchmarks.md", tmp_path / "docs" / "img"
    out.parent.mkdir()
    out.write_text(f"# Benchmarks\n\n{report.INTRO_BEGIN}\nKEEP THIS ANALYSIS\n{report.INTRO_END}\n\nold body\n")
    report.generate(data, copy_to=None, out_md=out, img_dir=img)
    text = out.read_text()
    assert "KEEP THIS ANALYSIS" in text and "old body" not in text
    assert "| metric | unit | local | fusestate-file | rclone |" in text
    assert "(0.20)" in text  # the newest result's ratio, not the older one's
    assert "error: link: Input/output error" in text
    assert "## Goals" in text and "db_bench fillrandom" in text
    assert (img / "rocksdb-wal-off.png").stat().st_size > 1000
    assert "](img/rocksdb-wal-off.png)" in text


def test_report_copies_its_data(tmp_path: Path) -> None:
    results, data = tmp_path / "results", tmp_path / "data"
    results.mkdir()
    data.mkdir()
    (data / "rocksdb-20260101-000000.json").write_text(json.dumps(fixture_doc("rocksdb", "2026-01-01T00:00:00")))
    (results / "rocksdb-20260102-000000.json").write_text(json.dumps(fixture_doc("rocksdb", "2026-01-02T00:00:00")))
    report.generate(results, copy_to=data, out_md=tmp_path / "b.md", img_dir=tmp_path / "img")
    assert [p.name for p in data.glob("*.json")] == ["rocksdb-20260102-000000.json"]


def test_run_list() -> None:
    proc = subprocess.run([str(RUN), "--list"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    assert names == ["rocksdb", "files", "bigstate", "checkpoint", "restore", "spark", "spark-restart", "spark-cluster"]


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio not installed")
def test_files_scenario_tiny(tmp_path: Path) -> None:
    results, work = tmp_path / "results", tmp_path / "work"
    env = dict(os.environ, FUSESTATE_RUNTIME_DIR=str(tmp_path / "run"))
    systems = ["local", "fusestate-file", "fusestate-pg"]
    proc = subprocess.run([str(RUN), "--tiny", "--scenario", "files", "--systems", ",".join(systems),
                           "--results", str(results), "--workdir", str(work), "--no-report"],
                          capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path, doc), = load_results(results).values()
    assert doc["scenario"] == "files" and doc["systems"] == systems
    assert doc["machine"]["cores"] and doc["machine"]["versions"]["fio"]
    assert {"create", "stat", "readdir", "rename", "unlink"} <= {row["metric"] for row in doc["summary"]}
    for row in doc["summary"]:
        for name in systems:
            cell = row["systems"][name]
            assert cell["median"] is not None and cell["median"] > 0, (row["metric"], name, cell)
    assert not any(is_mounted(p) for p in work.rglob("mnt"))


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
    assert "per GB on local disk" in sr.slope_sentence(doc)
    assert sr.ceiling_sentence(doc) == ""  # no floor measured: no ceiling claimed
    # A floor of 12 s (the faster setup) caps the ratio at 60 / 12 = 5x at 4 GB, 25 / 12 at 0.5 GB.
    floor_row = row(sr.FLOOR, 14.0, 12.0)
    doc.update(floor=[floor_row], params={"floor_keys": 5_000, "payload_bytes": 4096})
    assert sr.floor_seconds(doc) == 12.0
    ceiling = sr.ceiling_sentence(doc)
    assert "5.0× at 4 GB" in ceiling and "2.1× at 0.5 GB" in ceiling and "20.5 MB of state" in ceiling
    (goal,) = sr.goals(doc)
    assert goal["measured"] == "3.00× (20.0 s against 60.0 s; at most 5.0× over a 12.0 s floor)"


def test_restart_trials_parse_and_pair() -> None:
    """The trial tool's pieces: a variant's mount options, the daemon's latency histograms,
    and the per-round differences from the reference variant."""
    rt = pytest.importorskip("bench.restart_trials")
    assert rt.parse_variant("ra0=--readahead 0 --kernel-readahead 0") == ("ra0", ["--readahead", "0", "--kernel-readahead", "0"])
    assert rt.parse_variant("default=") == ("default", [])
    with pytest.raises(Exception, match="NAME=MOUNT-OPTIONS"):
        rt.parse_variant("=--readahead 0")
    text = ('# TYPE fusestate_block_read_seconds histogram\n'
            'fusestate_block_read_seconds_bucket{le="+Inf",source="range"} 4.0\n'
            'fusestate_block_read_seconds_count{source="range"} 4.0\n'
            'fusestate_block_read_seconds_sum{source="range"} 0.03\n')
    h = rt.parse_histograms(text)
    assert rt.mean_ms(h, "fusestate_block_read_seconds", "range") == 7.5
    assert rt.mean_ms(h, "fusestate_block_read_seconds", "remote") is None
    trials = [{"variant": v, "restart_s": s, "fetched_bytes": f, "range_read_ms": None}
              for v, s, f in (("a", 40.0, 3), ("b", 38.5, 2), ("a", 44.0, 3), ("b", 45.0, 2), ("a", 42.0, 5), ("b", 40.0, 2))]
    out = rt.summarize(trials, ["a", "b"])
    assert out["restart_minus_first_s"] == {"b": [-1.5, 1.0, -2.0]}
    assert out["medians"]["a"] == {"restart_s": 42.0, "fetched_bytes": 3}
    assert out["medians"]["b"]["restart_s"] == 40.0


def test_spark_bench_mounts_with_extra_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--mount-options reaches every fusestate mount spark_bench makes, the takeover mount too,
    after the harness's own options (so a variant can override them)."""
    sb = pytest.importorskip("bench.spark_bench")
    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(sb, "fs", lambda *a: calls.append(a) or "")
    args = argparse.Namespace(cache_size="1G", durability="remote", no_scratch=False,
                              mount_options="--whole-blocks always --durability local")
    sb.mount(tmp_path / "b", tmp_path / "m", tmp_path / "c", args, "--takeover")
    cmd = list(calls[0])
    assert cmd[cmd.index("--whole-blocks") + 1] == "always" and cmd[-1] == "--takeover"
    last = len(cmd) - 1 - cmd[::-1].index("--durability")
    assert cmd.index("--durability") < last and cmd[last + 1] == "local"  # the variant's comes last
    args.mount_options = ""
    sb.mount(tmp_path / "b", tmp_path / "m", tmp_path / "c", args)
    assert "--whole-blocks" not in calls[1] and calls[1][calls[1].index("--durability") + 1] == "remote"


@pytest.mark.slow
def test_restart_trials_tiny(tmp_path: Path) -> None:
    """Build a tiny state, then restart it once per variant from identical copies: each trial
    reports its restart and the bytes it fetched, and none leaves a mount or a copy behind."""
    tool = [sys.executable, str(ROOT / "bench" / "restart_trials.py")]
    work = tmp_path / "rt"
    subprocess.run([*tool, "build", "--work", str(work), "--keys", "2000", "--payload-bytes", "256",
                    "--events-per-batch", "1000", "--batches", "2"], check=True, capture_output=True, timeout=600)
    out = subprocess.run([*tool, "run", "--work", str(work), "--rounds", "1", "--restart-events", "200",
                          "--variant", "default=", "--variant", "no-readahead=--readahead 0"],
                         check=True, capture_output=True, text=True, timeout=600).stdout
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    trials, summary = lines[:-1], lines[-1]
    assert [t["variant"] for t in trials] == ["default", "no-readahead"]
    for t in trials:
        assert t["restart_s"] > 0 and t["fetched_bytes"] > 0 and t["full_fetches"] + t["range_reads"] > 0
        assert t["updates_ms"] >= 0 and t["commit_ms"] > 0
    assert set(summary["restart_minus_first_s"]) == {"no-readahead"}
    assert not is_mounted(work / "mnt")
    assert (work / "base").is_dir() and not (work / "trial-bucket").exists()


def test_daemon_cpu_reports_every_phase_for_both_trees(tmp_path: Path) -> None:
    """One GiB through a real mount, for this tree and (run interleaved) a second one: the
    daemon's CPU is counted in every phase, and no mount or bucket is left behind."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "daemon_cpu.py"), "--gib", "1", "--repeats", "1",
                          "--against", str(ROOT), "--workdir", str(tmp_path)],
                         check=True, capture_output=True, text=True, timeout=300).stdout
    runs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["source"] for r in runs] == ["this tree", str(ROOT)]
    for r in runs:
        for name in ("write", "read", "read_fresh"):
            assert r[name]["user_s_per_gib"] + r[name]["sys_s_per_gib"] > 0, (r["source"], name, r[name])
    assert "median daemon CPU seconds per GiB" in out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_spark_restart_on_s3_tiny() -> None:
    """A tiny state built on a moto bucket restarts on a fresh node with the options given:
    the restarted batch completes, its bytes come from the bucket, and no mount or work dir
    is left behind."""
    before = set(Path("/var/tmp").glob("spark-restart-s3-*"))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "spark_restart_s3.py"), "--keys", "2000",
                          "--payload-bytes", "256", "--events-per-batch", "1000", "--batches", "2", "--kinds", "s3",
                          "--", "--prefetch", "off"], check=True, capture_output=True, text=True, timeout=600).stdout
    (row,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert row["bucket"] == "s3" and row["restart_mount_options"] == ["--prefetch", "off"]
    assert row["restart_s"] > row["jvm_s"] > 0 and row["first_batch_ms"] > 0 and row["fetched_bytes"] > 0
    assert set(Path("/var/tmp").glob("spark-restart-s3-*")) == before
    assert "spark-restart-s3-" not in Path("/proc/mounts").read_text()
