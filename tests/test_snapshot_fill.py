"""A restarting Spark query's latest state snapshot, put into the page cache before its loads.

A checkpoint in Spark's RocksDB layout (``commits/N``, ``state/<op>/<part>/<v>.zip`` whose
``metadata`` names the SSTs, ``SSTs/``, ``<v>.changelog``) on a volume in moto, mounted on a
fresh node: ``fill_latest_snapshot`` must fetch each store's latest committed snapshot and the
changelogs after it, and none of the older versions' files, nor a snapshot newer than the last
committed batch. A load that links the files afterwards fetches nothing more.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

import pytest
from conftest import fusestate, mostly_resident, new_bucket, resident_bytes, wait_for

from fusestate.spark.snapshot_fill import fill_latest_snapshot

MIB = 1 << 20


def write(path: Path, data: bytes) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def snapshot(store: Path, version: int, ssts: dict[str, int]) -> list[Path]:
    """``<version>.zip`` naming new SSTs of these sizes (random bytes); returns their paths."""
    files = {f"{n:06d}-{name}.sst": size for n, (name, size) in enumerate(ssts.items(), start=8)}
    for name, size in files.items():
        write(store / "SSTs" / name, os.urandom(size))
    meta = {"sstFiles": [{"localFileName": name[:6] + ".sst", "dfsSstFileName": name, "sizeBytes": size}
                         for name, size in files.items()], "numKeys": 1}
    store.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(store / f"{version}.zip", "w") as z:
        z.writestr("CURRENT", "MANIFEST-000005\n")
        z.writestr("metadata", "v1\n" + json.dumps(meta))
    return [store / "SSTs" / name for name in files]


def test_a_restart_fills_the_latest_snapshot_and_not_older_versions(make_mount, tmp_path: Path,
                                                                     request) -> None:
    bucket = new_bucket("s3", tmp_path, request)
    m = make_mount(bucket).mount()
    ckpt = m.path / "job" / "checkpoints" / "q"
    for batch in range(3):  # batches 0-2 committed: the stores load version 3
        write(ckpt / "commits" / str(batch), b"v1\n{}")
    a, b = ckpt / "state" / "0" / "0", ckpt / "state" / "1" / "0"
    old = snapshot(a, 1, {"old1": 3 * MIB}) + snapshot(a, 2, {"old2": 3 * MIB})
    old += snapshot(a, 4, {"uncommitted": 3 * MIB})  # a batch that never committed wrote version 4
    latest = snapshot(a, 3, {"new1": 5 * MIB, "new2": 2 * MIB}) + snapshot(b, 2, {"b": 3 * MIB})
    for v in (1, 2):
        write(a / f"{v}.changelog", os.urandom(MIB))
        old.append(write(b / f"{v}.changelog", os.urandom(MIB)) and b / f"{v}.changelog")
    old += [a / "1.changelog", a / "2.changelog"]
    latest.append(b / "3.changelog")
    write(b / "3.changelog", os.urandom(MIB))
    (m.path / "job" / "work").mkdir()
    m.umount()

    m.wipe_cache()  # a fresh node
    m.mount()
    found = fill_latest_snapshot(ckpt, str(m.path))
    zips = [a / "3.zip", b / "2.zip"]
    assert sorted(found.paths) == sorted(map(str, latest + zips))
    wait_for(lambda: m.status()["page_fill"]["pending_bytes"] == 0, what="the fill to finish")
    st = m.status()
    fill, fetched = st["page_fill"], st["remote"]["bytes_in"]
    wanted = sum(p.stat().st_size for p in latest)
    assert fill["requested"] == found.queued >= len(latest) and fill["failures"] == fill["stopped"] == 0
    assert fill["bytes"] >= wanted
    # The latest snapshot's files are in the page cache, the older versions' are not, and
    # nothing of theirs crossed the network (each is at least 1 MiB).
    assert mostly_resident(latest, wanted), (resident_bytes(latest), wanted)
    assert resident_bytes(old) == 0
    assert wanted <= fetched < wanted + sum(p.stat().st_size for p in zips) + MIB, (fetched, wanted)
    # Held open until the loads link them: the kernel must not forget an inode being filled.
    assert len(found.held) == len(found.paths)
    found.release()

    # The load links the files into its working dir: nothing is fetched again (but the blocks
    # of any pages the kernel reclaimed since).
    for i, path in enumerate(latest):
        os.link(path, m.path / "job" / "work" / f"{i}")
    wait_for(lambda: m.status()["page_fill"]["pending_bytes"] == 0, what="any fill to finish")
    size = latest[0].stat().st_size
    dropped = size - resident_bytes(latest[:1])
    assert (m.path / "job" / "work" / "0").read_bytes() == latest[0].read_bytes()
    after = m.status()
    refetched = after["remote"]["bytes_in"] - fetched
    assert refetched <= (size if dropped else 0), (refetched, dropped)
    assert after["page_fill"]["files"] == fill["files"]


def test_spark_fill_names_what_it_queued(make_mount, file_bucket) -> None:
    """The command a job's launcher runs before spark-submit: one line, the files queued."""
    m = make_mount(file_bucket).mount()
    ckpt = m.path / "checkpoints" / "q"
    write(ckpt / "commits" / "0", b"v1\n{}")
    ssts = snapshot(ckpt / "state" / "0" / "0", 1, {"a": MIB, "b": MIB})
    m.umount()
    m.wipe_cache()
    m.mount()
    out = fusestate("spark-fill", f"fusestate://{ckpt}", "--wait").stdout
    # Three found: the zip, read to find the SSTs, is on this node already and is not queued.
    assert out.strip() == (f"{m.path}: 2 files (2 MiB) of 1 state stores' latest snapshot queued for the page "
                           f"cache (3 found, 2 MiB)"), out
    assert m.status()["page_fill"]["files"] == 2  # --wait returned once they were filled
    assert mostly_resident(ssts, 2 * MIB), resident_bytes(ssts)
    assert fusestate("spark-fill", str(m.path), check=False).stdout.startswith(f"{m.path}: 0 files")


def test_a_snapshot_larger_than_the_fill_budget_is_filled_whole(make_mount, tmp_path: Path, request) -> None:
    """A restart's request is not cut at the budget: what does not fit waits for the fills
    before it (up to twice the budget), so every file of the snapshot reaches the page cache."""
    bucket = new_bucket("s3", tmp_path, request)
    m = make_mount(bucket, extra=["--page-fill-budget", "4M"]).mount()
    ckpt = m.path / "checkpoints" / "q"
    write(ckpt / "commits" / "0", b"v1\n{}")
    ssts = snapshot(ckpt / "state" / "0" / "0", 1, {f"s{i}": 2 * MIB for i in range(4)})
    m.umount()
    m.wipe_cache()
    m.mount()
    out = fusestate("spark-fill", f"fusestate://{ckpt}", "--wait").stdout
    assert out.startswith(f"{m.path}: 4 files (8 MiB)"), out
    fill = m.status()["page_fill"]
    assert fill["files"] == fill["requested"] == 4 and fill["pending_bytes"] == 0, fill
    assert fill["budget_bytes"] == 4 * MIB
    assert mostly_resident(ssts, 8 * MIB), resident_bytes(ssts)


def java_check(where: Path, name: str, source: str, shim: Path, spark_jars: Path) -> str:
    """Compile a check program of the shim's package under ``where``; its class path."""
    src = where / "src" / "io" / "fusestate" / "hadoop" / f"{name}.java"
    src.parent.mkdir(parents=True)
    src.write_text(source)
    classpath = f"{shim}:{spark_jars}/*"
    subprocess.run(["javac", "-nowarn", "-d", str(where / "classes"), "-cp", classpath, str(src)],
                   check=True, capture_output=True, timeout=120)
    return f"{where / 'classes'}:{classpath}"


LIST_CHECK = """
package io.fusestate.hadoop;

public class ListCheck {
    public static void main(String[] args) throws Exception {
        for (String store : args) {
            for (java.nio.file.Path p : LatestSnapshot.files(java.nio.file.Paths.get(store))) {
                System.out.println(p);
            }
        }
    }
}
"""


def test_the_shim_lists_a_lost_store_as_the_restart_fill_does(tmp_path: Path) -> None:
    """The shim's LossFill plugin lists a lost store's files in Java: the same files as
    ``latest_snapshot_files`` (the last committed version's snapshot, the SSTs and logs its
    metadata names, the changelogs after it), and nothing of an uncommitted version."""
    if shutil.which("javac") is None:
        pytest.skip("no JDK on this machine")
    pyspark = pytest.importorskip("pyspark")
    from fusestate.spark.config import shim_jar
    from fusestate.spark.snapshot_fill import latest_snapshot_files

    ckpt = tmp_path / "q"
    for batch in range(3):
        write(ckpt / "commits" / str(batch), b"v1\n{}")
    a, b, c = ckpt / "state" / "0" / "0", ckpt / "state" / "0" / "1" / "left", ckpt / "state" / "1" / "0"
    snapshot(a, 2, {"old": 10})
    snapshot(a, 3, {"x": 10, "y": 20})
    snapshot(a, 4, {"uncommitted": 10})
    snapshot(b, 1, {"b": 10})
    for v in (1, 2, 3, 4):
        write(b / f"{v}.changelog", b"c")
    write(c / "1.changelog", b"c")  # no snapshot yet: the changelogs alone
    _, expected = latest_snapshot_files(ckpt)

    classpath = java_check(tmp_path, "ListCheck", LIST_CHECK, shim_jar(), Path(pyspark.__file__).parent / "jars")
    listed = subprocess.run(["java", "-cp", classpath, "io.fusestate.hadoop.ListCheck",
                             str(a), str(b), str(c)], check=True, capture_output=True, text=True, timeout=60)
    got = [Path(line) for line in listed.stdout.splitlines()]
    assert sorted(got) == sorted(expected) and len(got) == len(set(got))
    assert {a / "3.zip", b / "1.zip", b / "2.changelog", b / "3.changelog", c / "1.changelog"} <= set(got)
    assert not {a / "2.zip", a / "4.zip", b / "1.changelog", b / "4.changelog"} & set(got)
    assert not any("uncommitted" in p.name or "old" in p.name for p in got)


ASK_CHECK = """
package io.fusestate.hadoop;

public class AskCheck {
    public static void main(String[] args) {
        LossFill.Asked asked = LossFill.ask(java.util.Arrays.asList(args));
        System.out.println(asked.files.size() + " " + asked.bytes);
        System.out.println(asked.error == null ? "" : asked.error);
    }
}
"""
NOBODY = 65534


def test_an_executor_asks_its_daemon_through_the_mount_at_another_path_as_another_user(
        make_mount, tmp_path: Path, request) -> None:
    """LossFill asks for a fill by setting ``user.fusestate.fill`` on the store's directories,
    so an executor reaches its daemon where the control socket is out of reach: here as
    another user, on a bind mount of the volume at another path (a pod's view of it). A
    directory that user may not write refuses, and nothing of it is filled."""
    if shutil.which("javac") is None or shutil.which("setpriv") is None:
        pytest.skip("needs a JDK and setpriv")
    pyspark = pytest.importorskip("pyspark")
    from fusestate.spark.config import shim_jar

    spark_jars = Path(pyspark.__file__).parent / "jars"
    if subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "test", "-r",
                       str(next(spark_jars.glob("spark-core_*.jar")))], capture_output=True).returncode:
        pytest.skip(f"the user {NOBODY} cannot read {spark_jars}")
    bucket = new_bucket("s3", tmp_path, request)
    m = make_mount(bucket, extra=["--allow-other"]).mount()
    ckpt = m.path / "checkpoints" / "q"
    write(ckpt / "commits" / "0", b"v1\n{}")
    a, b = ckpt / "state" / "0" / "0", ckpt / "state" / "0" / "1"
    latest = snapshot(a, 1, {"a1": 2 * MIB, "a2": MIB})
    refused = snapshot(b, 1, {"b1": 2 * MIB})
    for path in [ckpt, ckpt / "state", ckpt / "state" / "0", a, a / "SSTs"]:
        os.chown(path, NOBODY, NOBODY)  # the executor's user wrote the store; b is root's
    m.umount()
    m.wipe_cache()  # a fresh node
    m.mount()

    view = Path(tempfile.mkdtemp(prefix="fusestate-pod-"))
    try:
        view.chmod(0o755)
        (view / "volume").mkdir()
        shutil.copy(shim_jar(), view / "shim.jar")
        classpath = java_check(view, "AskCheck", ASK_CHECK, view / "shim.jar", spark_jars)
        for d in view.rglob("*"):
            d.chmod(0o755 if d.is_dir() else 0o644)
        pod = view / "volume"
        stores = [str(pod / s.relative_to(m.path)) for s in (a, b)]
        script = (f'mount --bind "{m.path}" "{pod}" && exec setpriv --reuid={NOBODY} --regid={NOBODY} '
                  f'--clear-groups java -cp "{classpath}" io.fusestate.hadoop.AskCheck "$@"')
        proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *stores],
                              capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(view, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr
    counts, error = proc.stdout.split("\n")[:2]
    listed = latest + refused + [a / "1.zip", b / "1.zip"]
    assert counts == f"{len(listed)} {sum(p.stat().st_size for p in listed)}"
    assert "Permission denied" in error and str(pod / b.relative_to(m.path)) in error, error
    wait_for(lambda: m.status()["page_fill"]["pending_bytes"] == 0, what="the fill to finish")
    fill = m.status()["page_fill"]
    assert fill["requested"] == len(latest) and fill["failures"] == 0, fill  # a's zip: read here already
    assert mostly_resident(latest, 3 * MIB), resident_bytes(latest)
    assert resident_bytes(refused) == 0
