"""Restore benchmark: time to ready and bytes fetched for a fresh node, for two volume sizes.

For each size, a volume is filled through a mount and cleanly unmounted; then a
fresh node (empty cache dir) mounts it. We report the time until `fusestate mount`
returns with a ready mount, the bytes that crossed from the bucket to get there,
and — for comparison — the time a local-disk setup needs to download the whole
state before it can start.

    .venv/bin/python bench/restore_bench.py                 # 0.5 GiB and 8 GiB
    .venv/bin/python bench/restore_bench.py --sizes 0.25 1  # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FUSESTATE = str(Path(sys.executable).parent / "fusestate")
BLOCK = 4 << 20


def run(*args: str) -> str:
    return subprocess.run([FUSESTATE, *args], check=True, capture_output=True, text=True).stdout


def status(mnt: Path) -> dict:
    return json.loads(run("status", "--json", str(mnt)))


def fill_volume(bucket: Path, work: Path, gib: float, files: int) -> int:
    """Write ``gib`` GiB of distinct blocks through a mount; returns bytes written."""
    mnt, cache = work / "fill-mnt", work / "fill-cache"
    mnt.mkdir()
    run("mount", f"file://{bucket}", str(mnt), "--cache-dir", str(cache), "--cache-size", "4G")
    total = int(gib * (1 << 30))
    per_file = max(BLOCK, total // files)
    written = 0
    try:
        seed = os.urandom(BLOCK)
        n = 0
        while written < total:
            with open(mnt / f"sst-{n:05d}.sst", "wb") as f:
                size = min(per_file, total - written)
                for off in range(0, size, BLOCK):
                    # Distinct blocks, cheaply: a counter in front of a random block.
                    f.write((n * 1_000_003 + off).to_bytes(8, "little") + seed[8:min(BLOCK, size - off)])
                written += size
            n += 1
    finally:
        run("umount", str(mnt))
        shutil.rmtree(cache, ignore_errors=True)
    return written


def restore_once(bucket: Path, work: Path) -> dict:
    mnt, cache = work / "restore-mnt", work / "restore-cache"
    mnt.mkdir(exist_ok=True)
    shutil.rmtree(cache, ignore_errors=True)
    started = time.monotonic()
    run("mount", f"file://{bucket}", str(mnt), "--cache-dir", str(cache), "--cache-size", "4G")
    ready = time.monotonic() - started
    try:
        st = status(mnt)
        first = sorted(os.listdir(mnt))[0]
        with open(mnt / first, "rb") as f:
            f.read(4096)  # the mount serves data at once, fetched on demand
    finally:
        run("umount", str(mnt))
    return {"ready_seconds": ready, "restored_bytes": st["metadata"]["restored_bytes"],
            "bytes_in_at_ready": st["remote"]["bytes_in"], "files": st["files"]}


def download_first(bucket: Path, work: Path) -> float:
    """What a local-disk setup does before it can start: copy the whole state down."""
    target = work / "download"
    shutil.rmtree(target, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    started = time.monotonic()
    shutil.copytree(bucket / "blocks", target)
    subprocess.run(["sync"], check=True)
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.5, 8.0], help="volume sizes in GiB")
    parser.add_argument("--files", type=int, default=64, help="files per volume (SST-like)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="where buckets live (default: a temp dir)")
    args = parser.parse_args()

    results = []
    base = Path(args.workdir or tempfile.mkdtemp(prefix="fusestate-restore-bench-"))
    try:
        for gib in args.sizes:
            work = base / f"{gib}g"
            bucket = work / "bucket"
            bucket.mkdir(parents=True)
            written = fill_volume(bucket, work, gib, args.files)
            runs = [restore_once(bucket, work) for _ in range(args.repeats)]
            download = download_first(bucket, work)
            results.append({
                "size_gib": gib, "bytes": written,
                "ready_seconds_median": statistics.median(r["ready_seconds"] for r in runs),
                "restored_bytes": runs[-1]["restored_bytes"],
                "bytes_in_at_ready": runs[-1]["bytes_in_at_ready"],
                "download_first_seconds": download, "runs": runs,
            })
            shutil.rmtree(work, ignore_errors=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(base, ignore_errors=True)

    print(f"{'size':>8} {'ready (s)':>10} {'metadata fetched':>17} {'download first (s)':>19}")
    for r in results:
        print(f"{r['size_gib']:>6.2f}Gi {r['ready_seconds_median']:>10.2f} {r['restored_bytes']:>17,d} "
              f"{r['download_first_seconds']:>19.2f}")
    if len(results) >= 2:
        ratio = results[-1]["ready_seconds_median"] / results[0]["ready_seconds_median"]
        print(f"time-to-ready ratio {results[-1]['size_gib']} GiB / {results[0]['size_gib']} GiB: {ratio:.2f} "
              "(goal: under 1.5)")
    out = ROOT / "bench" / "results" / f"restore-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"results": results}, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
