"""The Spark cluster a user would deploy with JuiceFS instead of fusestate: every node's state
on its local disk, the checkpoint on one JuiceFS volume mounted at the same path on every node.

:class:`JuiceFSCluster` is the local-disk baseline (``bench.baseline_cluster``: no
fusestate mount, each node's Spark local dir on local disk) with its checkpoint at
``file://<mountpoint>/checkpoints``: Spark's RocksDB state store copies each snapshot's files
there and back through Hadoop's local file system, as it does to any shared directory. Each
node (its own mount and PID namespace) runs its own JuiceFS client: this module, run as a
script in front of the node's command, mounts the volume
(``juicefs mount -d``, the node's cache dir), runs the command, and unmounts once it ends.
Losing the node kills the namespace's processes, the JuiceFS client among them, at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

if not __package__:  # run by its path in a node's namespace: the repository's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.baseline_cluster import BaselineCluster  # noqa: E402
from fusestate.spark.cluster import ClusterError, Node  # noqa: E402

MOUNT_TIMEOUT = 120.0
RUN = "--run"  # the node's command follows (not "--": the node's own parser would take that)


class JuiceFSNode(Node):
    """A node whose command runs under its own JuiceFS mount of the volume."""

    def __init__(self, *args: object, juicefs: str, meta_url: str, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.juicefs = juicefs
        self.meta_url = meta_url

    @property
    def mounted_file(self) -> Path:
        return self.root / "juicefs-mounted"

    def start(self, command: list[str], env: Optional[dict[str, str]] = None,
              timeout: float = MOUNT_TIMEOUT) -> None:
        self.mounted_file.unlink(missing_ok=True)
        # By its path: the node's processes need not start in the repository's root.
        wrapped = [sys.executable, str(Path(__file__).resolve()), "--juicefs", self.juicefs, "--meta", self.meta_url,
                   "--mountpoint", self.mountpoint, "--cache-dir", str(self.cache_dir),
                   "--log", str(self.root / "juicefs.log"), "--mounted", str(self.mounted_file), RUN, *command]
        super().start(wrapped, env, timeout)
        deadline = time.monotonic() + timeout
        while not self.mounted_file.exists():
            if not self.alive() or time.monotonic() > deadline:
                self.kill()
                raise ClusterError(f"node {self.name}: JuiceFS did not mount; see {self.log}")
            time.sleep(0.1)
        text = self.mounted_file.read_text().strip()
        if text != "ok":
            self.wait(30)
            raise ClusterError(f"node {self.name}: {text.removeprefix('error: ')}")


class JuiceFSCluster(BaselineCluster):
    """The cluster with its checkpoint on a formatted JuiceFS volume (``meta_url``), mounted by
    every node at ``mountpoint``; each node's state on its local disk."""

    def __init__(self, root: str | os.PathLike, meta_url: str, *, mountpoint: str, juicefs: str,
                 **kw: object) -> None:
        super().__init__(root, mountpoint=mountpoint, checkpoint_root=f"file://{Path(mountpoint).resolve()}/checkpoints",
                         **kw)
        self.juicefs = juicefs
        self.juicefs_meta = meta_url
        Path(mountpoint).mkdir(parents=True, exist_ok=True)  # every node mounts over it, in its namespace

    def node(self, name: str, host: str, mount_args: Optional[list[str]]) -> Node:  # noqa: ARG002 - no fusestate
        root = self.root / "nodes" / name
        return JuiceFSNode(name, host, root, self.mountpoint, None, str(root / "spark-local"),
                           juicefs=self.juicefs, meta_url=self.juicefs_meta)


# --- in the node's namespace ---------------------------------------------------------------
def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/juicefs_cluster.py",
                                usage="%(prog)s --juicefs BIN --meta URL --mountpoint DIR --cache-dir DIR "
                                      f"--log FILE --mounted FILE {RUN} COMMAND...")
    for flag in ("--juicefs", "--meta", "--mountpoint", "--cache-dir", "--log", "--mounted"):
        p.add_argument(flag, required=True)
    argv = list(argv)
    cut = argv.index(RUN) if RUN in argv else len(argv)
    if cut >= len(argv) - 1:
        p.parse_args(argv[:cut])  # --help, or what else is missing
        p.error(f"a command to run after {RUN} is required")
    args = p.parse_args(argv[:cut])
    args.command = argv[cut + 1:]
    return args


def _announce(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


def _client_pid(mountpoint: str) -> Optional[int]:
    with contextlib.suppress(OSError, ValueError, KeyError):
        return int(json.loads((Path(mountpoint) / ".config").read_text())["Pid"])
    return None


def _unmount(juicefs: str, mountpoint: str) -> None:
    """``juicefs umount`` (a process of the node may hold a file for a moment: retried, then
    forced), then wait for the client to end its session before the namespace goes."""
    pid = _client_pid(mountpoint)
    for _ in range(10):
        if subprocess.run([juicefs, "umount", mountpoint], capture_output=True).returncode == 0:
            break
        time.sleep(1)
    else:
        subprocess.run([juicefs, "umount", "--force", mountpoint], capture_output=True)
    deadline = time.monotonic() + 30
    while pid is not None and time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return
        if state == "Z":  # ended; the namespace's first process reaps it
            return
        time.sleep(0.1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    mounted = Path(args.mounted)
    mount = [args.juicefs, "mount", "-d", args.meta, args.mountpoint, "--cache-dir", args.cache_dir,
             "--log", args.log, "--no-usage-report"]
    proc = subprocess.run(mount, capture_output=True, text=True)
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        _announce(mounted, f"error: juicefs mount at {args.mountpoint} failed: {reason[-300:]}")
        return 1
    child = subprocess.Popen(args.command)

    def forward(signum: int, frame: object) -> None:  # noqa: ARG001 - signal handler
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    _announce(mounted, "ok")
    try:
        return child.wait()
    finally:
        _unmount(args.juicefs, args.mountpoint)


if __name__ == "__main__":
    sys.exit(main())
