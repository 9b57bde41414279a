"""The shaped S3 endpoint's server: moto, each answer starting a time to first byte late and
each connection paced to one S3 connection's rate.

These two are added here, inside the endpoint's process (a WSGI wrapper around moto), and
not by ``tc netem``: the kernels this runs on build only the htb and tbf schedulers. For
request/response traffic the effect is the one a GET sees from S3: its answer starts
``latency_ms`` after it was sent, then streams at the connection's rate. The node's
bandwidth is ``tc``'s, on the veth pair :class:`bench.endpoints.ShapedMoto` puts this
server behind.

    python -m bench.shaped_s3 --host 127.0.0.1 --port 5000 --latency-ms 30   # until Ctrl-C
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable, Iterable, Optional

from bench.common import DEFAULT_CONNECTION_MBPS, DEFAULT_LATENCY_MS, Shape
from fusestate.namespaces import drop_copies_of_fuse_mounts

PACE_SLICE = 64 * 1024


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

    class OneContinue(MotoRequestHandler):
        """Answers ``Expect: 100-continue`` once, as S3 does. werkzeug writes its ``100 Continue``
        in ``run_wsgi``, and http.server's request parsing had written one already: the AWS SDK
        for Java's async client (S3A's uploads of whole files) took the second one for the final
        answer and failed every such upload with "Status Code: 100"."""

        def handle_expect_100(self) -> bool:
            return True

    app = DomainDispatcherApplication(create_backend_app)
    run_simple(host, port, shaped(app, shape), threaded=True, request_handler=OneContinue)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.shaped_s3", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--latency-ms", type=float, default=DEFAULT_LATENCY_MS)
    parser.add_argument("--connection-mbps", type=float, default=DEFAULT_CONNECTION_MBPS)
    parser.add_argument("--own-mount-namespace", action="store_true",
                        help="started in a mount namespace of its own (ip netns exec): drop its copies of FUSE mounts")
    args = parser.parse_args(argv)
    if args.own_mount_namespace:
        drop_copies_of_fuse_mounts()
    serve(args.host, args.port, Shape(latency_ms=args.latency_ms, connection_mbps=args.connection_mbps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
