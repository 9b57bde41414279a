"""A shared volume whose database is highly available: libpq multi-host URLs in every
command that takes --meta, and mounts that follow the primary through a failover."""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import Bucket, assert_one_line_error, fusestate
from fusestate.meta.local_postgres import free_port


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def multi_host(pg_url: str) -> str:
    """``pg_url`` behind a first server that is down: libpq skips it."""
    user, rest = pg_url.split("://", 1)[1].split("@", 1)
    server, database = rest.split("/", 1)
    return (f"postgresql://{user}@127.0.0.1:{free_port()},{server}/{database}"
            "?target_session_attrs=read-write&connect_timeout=2")


def test_every_command_takes_a_multi_host_url(make_mount, file_bucket: Bucket, pg_url: str,
                                              postgres_server) -> None:
    """mount, status, fsck and gc with ``postgresql://h1:p1,h2:p2/db?target_session_attrs=read-write``
    (the first server down), and --meta-outage-budget; a volume made through one server
    is mounted through a list that names it."""
    url = multi_host(pg_url)
    opts = ["--meta", url, "--metrics-addr", "off", "--meta-outage-budget", "20"]
    a = make_mount(file_bucket, name="node-a", cache="cache-a", extra=opts).mount()
    write_synced(a.path / "f", b"x" * 100_000)
    assert fusestate("status", str(a.path)).returncode == 0
    a.umount()
    b = make_mount(file_bucket, name="node-b", cache="cache-b",
                   extra=["--meta", pg_url, "--metrics-addr", "off"]).mount()
    assert (b.path / "f").read_bytes() == b"x" * 100_000
    report = json.loads(fusestate("fsck", file_bucket.url, "--meta", url, "--json").stdout)
    assert report["healthy"] and report["referenced"] == 1, report
    assert report["engine"].startswith("postgresql://127.0.0.1:")
    assert "unreferenced" in fusestate("gc", file_bucket.url, "--meta", url, "--dry-run").stdout
    b.umount()
    other = multi_host(postgres_server.create_database("other" + os.urandom(4).hex()))
    refused = make_mount(file_bucket, name="node-c", cache="cache-c", extra=["--meta", other, "--metrics-addr", "off"])
    assert_one_line_error(refused.try_mount(), "keeps its metadata in postgresql://127.0.0.1:")
    bad = make_mount(file_bucket, name="node-d", cache="cache-d",
                     extra=["--meta", pg_url, "--meta-outage-budget", "0"])
    assert_one_line_error(bad.try_mount(), "--meta-outage-budget")
