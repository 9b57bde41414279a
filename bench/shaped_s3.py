"""An S3 endpoint that behaves like a remote one, for tests and benchmarks.

A moto S3 server in a network namespace of its own, reached over a veth pair on a private
/30: every request pays a time to first byte, every connection is paced to one S3
connection's throughput, and the link is limited to one node's bandwidth by ``tc``
(an htb class on each end of the veth pair). The defaults follow Amazon's published
S3 figures (bench/README.md cites them) and are flags of ``bench/run``.

The time to first byte and the per-connection pacing are added inside the endpoint's
process (a WSGI wrapper around moto), not by ``tc netem``: the kernels this runs on
build only the htb and tbf schedulers. For request/response traffic the effect is the
same a GET sees from S3: its answer starts ``latency_ms`` after it was sent, then
streams at the connection's rate within the node's bandwidth.

    python -m bench.shaped_s3 --latency-ms 30      # an endpoint until Ctrl-C
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from bench.systems import BIN, Moto, wait_or_kill

# Amazon S3's performance guidelines: small GETs and PUTs have median latencies "in the tens
# of milliseconds", and one connection carries 85-90 MB/s ("make one concurrent request for
# each 85-90 MB/s of desired network throughput"). A node's share of the network: a few
# hundred MB/s (an instance with "up to 10 Gbit/s" sustains a fraction of it).
DEFAULT_LATENCY_MS = 30.0
DEFAULT_CONNECTION_MBPS = 88.0
DEFAULT_NODE_MBPS = 300.0
PORT = 5000
SUBNETS = ipaddress.ip_network("10.213.0.0/16")  # /30s for the endpoints: private, picked by the harness
PACE_SLICE = 64 * 1024


@dataclass(frozen=True)
class Shape:
    """What the endpoint looks like from a node: MB/s are 10^6 bytes per second."""

    latency_ms: float = DEFAULT_LATENCY_MS
    connection_mbps: float = DEFAULT_CONNECTION_MBPS
    node_mbps: float = DEFAULT_NODE_MBPS

    def describe(self) -> str:
        return (f"{self.latency_ms:g} ms to first byte, {self.connection_mbps:g} MB/s per connection, "
                f"{self.node_mbps:g} MB/s per node")


# --- the endpoint's process ---------------------------------------------------------------
class Pacer:
    """Holds one connection's bytes to a rate: the n-th byte leaves no earlier than n / rate."""

    def __init__(self, bytes_per_second: float) -> None:
        self.rate = bytes_per_second
        self.start = time.monotonic()
        self.sent = 0

    def wait(self, nbytes: int) -> None:
        self.sent += nbytes
        delay = self.start + self.sent / self.rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class PacedInput:
    """A request body read at the connection's rate (uploads)."""

    def __init__(self, stream: Any, pacer: Pacer) -> None:
        self.stream, self.pacer = stream, pacer

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.pacer.wait(len(data))
        return data

    def readline(self, size: int = -1) -> bytes:
        data = self.stream.readline(size)
        self.pacer.wait(len(data))
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def shaped(app: Callable, shape: Shape) -> Callable:
    """A WSGI app whose every answer starts ``latency_ms`` late and streams at the connection's rate."""
    rate = shape.connection_mbps * 1e6

    def application(environ: dict, start_response: Callable) -> Iterable[bytes]:
        pacer = Pacer(rate)
        environ["wsgi.input"] = PacedInput(environ["wsgi.input"], pacer)
        time.sleep(shape.latency_ms / 1e3)
        body = app(environ, start_response)
        try:
            for chunk in body:
                for offset in range(0, len(chunk), PACE_SLICE):
                    piece = chunk[offset:offset + PACE_SLICE]
                    pacer.wait(len(piece))
                    yield piece
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()

    return application


def serve(host: str, port: int, shape: Shape) -> None:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    app = DomainDispatcherApplication(create_backend_app)
    run_simple(host, port, shaped(app, shape), threaded=True, request_handler=MotoRequestHandler)


# --- the harness side ------------------------------------------------------------------------
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
               "--connection-mbps", str(s.connection_mbps)]
        with open(self.work / "moto.log", "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         cwd=Path(__file__).resolve().parent.parent)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        import socket

        assert self.subnet is not None and self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the shaped endpoint exited; see {self.work / 'moto.log'}")
            with contextlib.suppress(OSError), socket.create_connection((str(self.subnet[2]), PORT), timeout=1):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the shaped endpoint did not answer in {timeout:.0f} s")

    def __exit__(self, *exc: Any) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            wait_or_kill(self.proc, timeout=10)
        with contextlib.suppress(RuntimeError):
            _ip("netns", "del", self.netns)  # takes the veth pair with it


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.shaped_s3", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument("--latency-ms", type=float, default=DEFAULT_LATENCY_MS)
    parser.add_argument("--connection-mbps", type=float, default=DEFAULT_CONNECTION_MBPS)
    args = parser.parse_args(argv)
    serve(args.host, args.port, Shape(args.latency_ms, args.connection_mbps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
