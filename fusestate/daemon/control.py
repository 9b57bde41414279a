"""The control socket: one JSON request per connection, one JSON reply.

``status`` returns the daemon's numbers; ``umount`` flushes everything,
unmounts, and replies only once the daemon has nothing left to upload.
"""

from __future__ import annotations

import json
import os
import socket
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional

from fusestate.daemon.paths import control_socket
from fusestate.errors import UserError

if TYPE_CHECKING:  # the daemon's side only: a client (every CLI command) does not load trio
    import trio

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


async def serve(path: str, handler: Handler, task_status: Optional[trio.TaskStatus] = None) -> None:
    import trio

    if task_status is None:
        task_status = trio.TASK_STATUS_IGNORED
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(16)
    task_status.started()
    try:
        async with trio.open_nursery() as nursery:
            while True:
                conn, _ = await listener.accept()
                nursery.start_soon(_handle, trio.SocketStream(conn), handler)
    finally:
        listener.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


async def _handle(stream: trio.SocketStream, handler: Handler) -> None:
    import trio

    async with stream:
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            buf += chunk
        try:
            request = json.loads(buf)
            reply = await handler(request)
        except Exception as exc:  # noqa: BLE001 - the client gets the message
            reply = {"ok": False, "error": str(exc)}
        try:
            await stream.send_all(json.dumps(reply).encode() + b"\n")
        except trio.BrokenResourceError:
            pass


def request(path: str, message: dict[str, Any], timeout: float | None = 30.0) -> dict[str, Any]:
    """Blocking client used by the CLI."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            raise UserError("no fusestate daemon serves this mountpoint") from None
        sock.sendall(json.dumps(message).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            buf += chunk
    except socket.timeout:
        raise UserError("the fusestate daemon did not answer in time") from None
    finally:
        sock.close()
    if not buf:
        raise UserError("the fusestate daemon closed the connection without an answer")
    return json.loads(buf)


def fetch_status(mountpoint: str, runtime: str | None = None) -> dict[str, Any]:
    """The daemon's numbers for a mountpoint, asked over its control socket: in-process,
    so a caller on a restart's critical path (the Spark pipeline) spawns no CLI."""
    mountpoint = os.path.abspath(mountpoint)
    path = control_socket(mountpoint, runtime)
    if not os.path.exists(path):
        raise UserError(f"{mountpoint} is not a fusestate mount")
    reply = request(path, {"command": "status"})
    if not reply.get("ok"):
        raise UserError(reply.get("error", "status failed"))
    return reply["status"]
