"""Scenario 5: a fresh node restoring state of several sizes — fusestate mount vs downloading first.

For each size a volume of SST-like files (distinct 4 MiB blocks) is written through a
mount and cleanly unmounted. A fresh node (empty cache dir) then mounts it: time to ready
is until ``fusestate mount`` returns plus the first 4 KiB read of a file, and bytes fetched
are what crossed from the bucket by then. The baseline is what a local-disk setup must do
before it can open its state: download the whole prefix to local disk with fsspec
(``get`` recursive, then sync). Fresh mounts and downloads alternate, size by size.
The mounts run with ``--prefetch off``: background cache warming would add its fetches to
the bytes counted here, and it is the restore before the first read that is measured.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from bench.common import Choices, Context, Metric, error_text, fmt_num, log, record, summarize
from bench.render import goal_row, md_table, medians_note, points_plot, table_cell
from bench.systems import FusestateSystem, Moto, make_system, moto_if_needed

NAME = "restore"
TITLE = "Restore on a fresh node"
SUMMARY = "time to ready and bytes fetched for a fresh node, several state sizes, vs downloading the state first"
BUDGET = {"tiny": None, "quick": 80.0, "full": None}
BLOCK = 4 << 20
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"sizes_gib": {"file": [0.01, 0.03]}, "files": 8},
    "quick": {"sizes_gib": {"file": [0.5, 2.0]}, "files": 64},
    "full": {"sizes_gib": {"file": [0.5, 2.0, 8.0], "s3": [0.5, 2.0]}, "files": 64},
}
METRICS = [
    Metric("mount_s", "s", higher_is_better=False, label="fusestate mount returned"),
    Metric("ready_s", "s", higher_is_better=False, label="time to ready (first read served)"),
    Metric("metadata_bytes", "B", higher_is_better=False, label="bytes fetched by the mount"),
    Metric("fetched_bytes", "B", higher_is_better=False, label="bytes fetched until ready"),
]
BASE = "download first"
FUSE = "fusestate"


def fill(s: FusestateSystem, gib: float, files: int) -> int:
    """Write ``gib`` GiB of distinct blocks in ``files`` files through the mount; returns bytes."""
    total = int(gib * (1 << 30))
    per_file = max(BLOCK, total // files)
    seed = os.urandom(BLOCK)
    written = n = 0
    while written < total:
        size = min(per_file, total - written)
        with open(s.mnt / f"{n:06d}.sst", "wb") as f:
            for off in range(0, size, BLOCK):
                # Distinct blocks, cheaply: a counter in front of one random block.
                f.write((n * 1_000_003 + off).to_bytes(8, "little") + seed[8:min(BLOCK, size - off)])
        written += size
        n += 1
    return written


def fresh_mount(s: FusestateSystem) -> dict[str, Any]:
    shutil.rmtree(s.cache, ignore_errors=True)
    t = time.monotonic()
    s.start()
    mounted = time.monotonic() - t
    at_mount = s.status()
    first = sorted(os.listdir(s.mnt))[0]
    with open(s.mnt / first, "rb") as f:
        f.read(4096)
    ready = time.monotonic() - t
    st = s.status()
    s.stop()
    # bytes_in counts everything read from the bucket: volume file, leases, metadata, blocks.
    return {"metrics": {"mount_s": mounted, "ready_s": ready, "metadata_bytes": at_mount["remote"]["bytes_in"],
                        "fetched_bytes": st["remote"]["bytes_in"]},
            "restored_metadata_bytes": at_mount["metadata"]["restored_bytes"], "files": st["files"]}


def download_first(fs: Any, prefix: str, target: Path) -> dict[str, Any]:
    shutil.rmtree(target, ignore_errors=True)
    t = time.monotonic()
    fs.get(prefix.rstrip("/") + "/", str(target) + "/", recursive=True)
    os.sync()
    ready = time.monotonic() - t
    got = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    shutil.rmtree(target, ignore_errors=True)
    return {"metrics": {"ready_s": ready, "fetched_bytes": got}}


def make_volume(backend: str, gib: float, work: Path, moto: Optional[Moto], files: int,
                options: list[str]) -> dict[str, Any]:
    name = "fusestate-file" if backend == "file" else "fusestate-s3"
    # Warming after the mount is off: this scenario measures the restore itself (what the mount
    # fetches before it answers); the spark scenario runs with warming on, the default.
    s = make_system(name, work / f"{backend}-{gib:g}g", moto, cache_size="8G",
                    fusestate_extra=["--prefetch", "off", *options])
    assert isinstance(s, FusestateSystem)
    t = time.monotonic()
    s.start()
    try:
        written = fill(s, gib, files)
    finally:
        s.stop()
    shutil.rmtree(s.cache, ignore_errors=True)
    if backend == "file":
        import fsspec

        fs, prefix = fsspec.filesystem("file"), s.url[len("file://"):]
    else:
        assert moto is not None
        fs, prefix = moto.fsspec(), s.url[len("s3://"):]
    log(f"  restore: {backend} volume of {gib:g} GiB written in {time.monotonic() - t:.0f} s")
    return {"system": s, "bytes": written, "fs": fs, "prefix": prefix}


def choices(size: str) -> Choices:
    """The systems ``--systems`` may name here (a volume on each backend the size restores from), and
    those run without it at ``size``."""
    names = [f"fusestate-{b}" for b in SIZES[size]["sizes_gib"]]
    return Choices(names, names)


def run(ctx: Context) -> dict[str, Any]:
    p = ctx.pick(SIZES)
    chosen = ctx.chosen(choices(ctx.size))
    backends = [b for b in p["sizes_gib"] if f"fusestate-{b}" in chosen]
    variants = [(b, g) for b in backends for g in p["sizes_gib"][b]]
    runs: list[dict[str, Any]] = []
    volumes: dict[str, dict[str, Any]] = {}
    needs = ["fusestate-s3"] if "s3" in backends else []
    with moto_if_needed(needs, ctx.work) as moto:
        try:
            for b, g in variants:
                key = f"{b}:// {g:g} GiB"
                try:
                    volumes[key] = make_volume(b, g, ctx.work, moto, p["files"], ctx.mount_options)
                except Exception as exc:  # noqa: BLE001
                    volumes[key] = {"error": error_text(exc)}
            for repeat in ctx.repetitions():
                for key, vol in volumes.items():
                    for system in (FUSE, BASE):
                        runs.append(_one(system, key, vol, repeat, ctx.work))
        finally:
            for vol in volumes.values():
                if "system" in vol:
                    vol["system"].stop()
    rows = summarize(runs, METRICS, [BASE, FUSE], list(volumes), baseline=BASE)
    sizes = {k: v.get("bytes") for k, v in volumes.items()}
    return {"params": {**p, "block_bytes": BLOCK}, "systems": [BASE, FUSE], "volumes": sizes, "summary": rows,
            "runs": runs}


def _one(system: str, key: str, vol: dict[str, Any], repeat: int, work: Path) -> dict[str, Any]:
    if "error" in vol:
        return record(system, repeat, key, error=f"filling the volume: {vol['error']}")
    try:
        if system == FUSE:
            out = fresh_mount(vol["system"])
        else:
            out = download_first(vol["fs"], vol["prefix"], work / "download")
    except Exception as exc:  # noqa: BLE001
        vol["system"].stop()
        log(f"  restore r{repeat + 1} {key} {system}: ERROR {error_text(exc)}")
        return record(system, repeat, key, error=error_text(exc))
    m = out.pop("metrics")
    log(f"  restore r{repeat + 1} {key:<14} {system:<15} ready {m['ready_s']:.2f} s, "
        f"fetched {fmt_num(m['fetched_bytes'], 'B')}")
    return record(system, repeat, key, m, **out)


def _size_of(key: str) -> float:
    return float(key.split()[1])


def pivot_table(doc: dict[str, Any]) -> str:
    """One row per volume: the time to ready and the bytes fetched, both ways."""
    by = {(r["variant"], r["metric"]): r for r in doc["summary"]}
    cols = [(BASE, "ready_s"), (FUSE, "mount_s"), (FUSE, "ready_s"), (BASE, "fetched_bytes"),
            (FUSE, "metadata_bytes"), (FUSE, "fetched_bytes")]
    head = ["volume", "download first: ready (s)", "fusestate: mount returned (s)", "fusestate: ready (s)",
            "download first: fetched", "fusestate: fetched by the mount", "fusestate: fetched until ready"]
    body = [[variant, *(table_cell(by[(variant, m)], system) if (variant, m) in by else "" for system, m in cols)]
            for variant in doc["volumes"]]
    return md_table(head, body)


def render(doc: dict[str, Any], img_dir: Path, img_rel: str) -> str:
    p = doc["params"]
    parts = [f"Volumes of {p['files']} files of distinct 4 MiB blocks, written through a mount and cleanly "
             f"unmounted. *fusestate*: a fresh node (empty cache dir) runs `fusestate mount` and reads the first "
             f"4 KiB of one file (which fetches that file's first block); the mount itself fetches only metadata "
             f"(`--prefetch off`: no cache warming after the mount). *download first*: fsspec `get` of the volume's "
             f"whole prefix to local disk, then `sync`. " + medians_note(doc, "downloading first"),
             pivot_table(doc)]
    series: dict[str, tuple[list[float], list[float]]] = {}
    for backend in sorted({k.split()[0] for k in doc["volumes"]}):
        for system in doc["systems"]:
            label = system if backend == "file://" else f"{system} ({backend})"
            series[label] = [(_size_of(r["variant"]), r["systems"][system]["median"]) for r in doc["summary"]
                             if r["metric"] == "ready_s" and r["variant"].startswith(backend)
                             and r["systems"].get(system, {}).get("median") is not None]
    plot = points_plot(img_dir / "restore-time.png", series, img_rel, "restore time", xlabel="state size (GiB)",
                       ylabel="seconds to ready", title="Restore on a fresh node: time to ready against state size")
    if plot:
        parts.append(plot)
    return "\n\n".join(parts)


def goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for backend in sorted({k.split()[0] for k in doc["volumes"]}):
        pts = sorted((_size_of(r["variant"]), r["systems"].get(FUSE, {}).get("median")) for r in doc["summary"]
                     if r["metric"] == "ready_s" and r["variant"].startswith(backend))
        pts = [(x, y) for x, y in pts if y is not None]
        if len(pts) < 2:
            continue
        (x0, y0), (x1, y1) = pts[0], pts[-1]
        ratio = y1 / y0 if y0 else None
        out.append(goal_row(f"restore ({backend}): time to ready independent of state size "
                            f"({x1:g} GiB / {x0:g} GiB < 1.5; goal spans 0.5 to 8 GiB)",
                            f"{y0:.2f} s → {y1:.2f} s, ratio {ratio:.2f}" if ratio else "—",
                            ratio is not None and ratio < 1.5))
    return out

