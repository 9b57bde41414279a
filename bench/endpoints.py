"""The S3 endpoints of the S3-backed systems: a plain moto server on 127.0.0.1, and the
shaped one (moto behind :mod:`bench.shaped_s3`'s shaping, in a network namespace of its
own behind a veth pair whose every direction ``tc`` caps at a node's bandwidth).

The shaped endpoint's network is the harness's own: a namespace, a veth pair on a /30
from 10.213.0.0/16 that no interface uses yet, an htb class on each end. Leaving the
context deletes the namespace, and the pair with it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any, Optional

from bench.common import BIN, Shape, wait_or_kill, wait_port
from fusestate.harness.postgres import free_port

PORT = 5000                                      # the shaped endpoint's, on its own address
SPILL_BYTES = 256 * 1024                         # the shaped endpoint keeps larger objects on disk
SUBNETS = ipaddress.ip_network("10.213.0.0/16")  # its /30s: private, picked by the harness


class Moto:
    """A moto S3 server on 127.0.0.1 and a free port, for the S3-backed systems of one scenario."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Moto":
        self.work.mkdir(parents=True, exist_ok=True)
        with open(self.work / "moto.log", "w") as out:
            self.proc = subprocess.Popen([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        wait_port(self.port)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            wait_or_kill(self.proc, timeout=10)

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def create_bucket(self, prefix: str) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.client().create_bucket(Bucket=name)
        return name

    def bucket_bytes(self, bucket: str) -> int:
        """Bytes stored in a bucket (for peers, whose uploads we cannot count otherwise)."""
        total = 0
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket):
            total += sum(o["Size"] for o in page.get("Contents", []))
        return total

    def fsspec(self):
        import fsspec

        return fsspec.filesystem("s3", key="testing", secret="testing", skip_instance_cache=True,
                                 client_kwargs={"endpoint_url": self.endpoint, "region_name": "us-east-1"})


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def _tc(*args: str) -> None:
    proc = subprocess.run(["tc", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {proc.stderr.strip()}")


def _free_subnet() -> ipaddress.IPv4Network:
    used = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    for subnet in SUBNETS.subnets(new_prefix=30):
        if f" {subnet[1]}/" not in used and f" {subnet[2]}/" not in used:
            return subnet
    raise RuntimeError(f"no free /30 left in {SUBNETS}")


def limit_link(dev: str, mbps: float, netns: Optional[str] = None) -> None:
    """Cap a device's sending rate with an htb class (the node's bandwidth, one direction)."""
    where = ["-n", netns] if netns else []
    rate = f"{int(mbps * 8)}mbit"
    _tc(*where, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1", "r2q", "1000")
    _tc(*where, "class", "replace", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate)


class ShapedMoto(Moto):
    """A moto endpoint in its own network namespace, behind a shaped veth pair."""

    def __init__(self, work: Path, shape: Shape = Shape()) -> None:
        super().__init__(work)
        self.shape = shape
        tag = uuid.uuid4().hex[:6]
        self.netns, self.host_dev, self.peer_dev = f"fsb-{tag}", f"fsb{tag}h", f"fsb{tag}p"
        self.subnet: Optional[ipaddress.IPv4Network] = None

    def __enter__(self) -> "ShapedMoto":
        self.work.mkdir(parents=True, exist_ok=True)
        try:
            self._make_link()
            self._start_server()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _make_link(self) -> None:
        self.subnet = _free_subnet()
        host, peer = str(self.subnet[1]), str(self.subnet[2])
        _ip("netns", "add", self.netns)
        _ip("link", "add", self.host_dev, "type", "veth", "peer", "name", self.peer_dev, "netns", self.netns)
        _ip("addr", "add", f"{host}/30", "dev", self.host_dev)
        _ip("link", "set", self.host_dev, "up")
        _ip("-n", self.netns, "addr", "add", f"{peer}/30", "dev", self.peer_dev)
        _ip("-n", self.netns, "link", "set", self.peer_dev, "up")
        _ip("-n", self.netns, "link", "set", "lo", "up")
        limit_link(self.host_dev, self.shape.node_mbps)                  # uploads
        limit_link(self.peer_dev, self.shape.node_mbps, self.netns)      # downloads
        self.port = PORT
        self.endpoint = f"http://{peer}:{PORT}"

    def _start_server(self) -> None:
        assert self.subnet is not None
        s = self.shape
        cmd = ["ip", "netns", "exec", self.netns, str(BIN / "python"), "-m", "bench.shaped_s3",
               "--host", str(self.subnet[2]), "--port", str(PORT), "--latency-ms", str(s.latency_ms),
               "--connection-mbps", str(s.connection_mbps), "--own-mount-namespace"]
        # moto keeps an object under 5 MB in memory: fusestate's 4 MiB blocks of a Spark state of a few
        # GB (every retained version's SSTs) took 15 GB of the machine's 24, and the page cache with
        # it. Objects above this size go to temporary files in the work dir instead.
        env = dict(os.environ, MOTO_S3_DEFAULT_KEY_BUFFER_SIZE=str(SPILL_BYTES), TMPDIR=str(self.work))
        with open(self.work / "moto.log", "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         cwd=Path(__file__).resolve().parent.parent, env=env)
        wait_port(PORT, host=str(self.subnet[2]))

    def __exit__(self, *exc: Any) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            wait_or_kill(self.proc, timeout=10)
        with contextlib.suppress(RuntimeError):
            _ip("link", "del", self.host_dev)  # both ends, at once (a namespace's deletion frees them later)
        with contextlib.suppress(RuntimeError):
            _ip("netns", "del", self.netns)
