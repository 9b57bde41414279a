"""The fusestate command line: mount, umount, status, stats, warmup, fsck, gc, and the Spark helpers."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from typing import Optional, Sequence

from fusestate import __version__
from fusestate.config import (DEFAULT_BLOCK_SIZE, FRONTENDS, DEFAULT_METRICS_PORT, METRICS_PORTS,
                              PREFETCH_LINK_MODES, PREFETCH_MODES, WHOLE_BLOCK_MODES, MountConfig, format_size,
                              meta_url_of, parse_size)
from fusestate.errors import UserError
from fusestate.spark.arguments import cluster_arguments, pipeline_arguments

READY_FD_ENV = "FUSESTATE_READY_FD"
STATUS_SESSION_LOST = 1  # `status` exit code of a mount that can publish nothing more (session or lease lost): remount it


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusestate", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fusestate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    m = sub.add_parser("mount", help="mount a bucket as a POSIX directory")
    _add_mount_arguments(m)

    u = sub.add_parser("umount", help="flush every dirty block, then unmount")
    u.add_argument("mountpoint")
    u.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")

    s = sub.add_parser("status", help="cache, staging, upload queue at a glance")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--warm", nargs="?", const="", default=None, metavar="PATH",
                   help="which files under PATH (default: the whole volume) this node holds in its cache, "
                        "by directory: where a shared volume's state is warm")

    c = sub.add_parser("fsck", help="verify a volume in the bucket (exit 1 if damaged)")
    c.add_argument("url")
    c.add_argument("--endpoint-url", default=None)
    c.add_argument("--quick", action="store_true", help="check that blocks exist, without hashing them")
    c.add_argument("--all-restore-points", action="store_true",
                   help="also check every restore point of the journal, not only the newest")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    _add_meta_argument(c)

    g = sub.add_parser("gc", help="delete blocks no restore point references")
    g.add_argument("url")
    g.add_argument("--endpoint-url", default=None)
    g.add_argument("--grace", type=float, default=_default("gc_grace"),
                   help="keep unreferenced blocks younger than this many seconds (default %(default)s)")
    g.add_argument("--dry-run", action="store_true", help="only report what would be deleted")
    g.add_argument("--force", action="store_true", help="run even while a daemon holds the volume "
                   "(a shared volume's gc always may)")
    _add_meta_argument(g)

    t = sub.add_parser("stats", help="live rates and queues, refreshed like top")
    t.add_argument("mountpoint")
    t.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default %(default)s)")
    t.add_argument("--count", type=int, default=0, help="stop after this many refreshes (default: run until Ctrl-C)")

    w = sub.add_parser("warmup", help="fetch files into the local cache")
    w.add_argument("paths", nargs="+")

    sf = sub.add_parser("spark-fill", help="before a Spark query restarts: put its state stores' latest snapshot "
                                           "into the page cache")
    sf.add_argument("checkpoint", help="the query's checkpoint location on a mount (a path, file:// or fusestate://)")
    sf.add_argument("--wait", action="store_true",
                    help="hold the files open until the daemon has filled them, then exit (without it: exit at once, "
                         "and under memory pressure the kernel may forget a file before it is filled)")

    sp = sub.add_parser("spark-pipeline", help="run the reference Spark streaming job with its state on a mount")
    pipeline_arguments(sp)

    sc = sub.add_parser("spark-cluster", help="run the reference Spark job on a cluster of nodes, one shared volume")
    cluster_arguments(sc)
    return parser


def _add_meta_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--meta", default=os.environ.get("FUSESTATE_META_URL") or None, metavar="URL",
                        help="metadata engine: 'sqlite' (the embedded default: one writer per volume) or "
                             "postgresql://[user@]host[:port][,host2[:port]...]/database, shared by every node "
                             "that mounts the volume read-write at once (a primary and its standbys: add "
                             "?target_session_attrs=read-write; credentials as libpq takes them: PGPASSWORD, "
                             "~/.pgpass, PGSSLMODE); default $FUSESTATE_META_URL, else sqlite")


def _default(name: str) -> object:
    """A mount option's default, as ``MountConfig`` defines it: the one place defaults live."""
    return MountConfig.__dataclass_fields__[name].default


def _size_default(name: str) -> str:
    return format_size(int(_default(name))).replace(" ", "")  # type: ignore[call-overload]


def _add_mount_arguments(m: argparse.ArgumentParser) -> None:
    """The mount options. Each default is left out of the parsed arguments (SUPPRESS), so
    ``MountConfig`` fills it in and the help text shows the same value."""
    unset = argparse.SUPPRESS
    m.add_argument("url", help="bucket URL: file:///path, s3://bucket/prefix, gs://bucket/prefix")
    m.add_argument("mountpoint")
    m.add_argument("--cache-dir", default=unset,
                   help=f"local cache, staging and metadata (default {_default('cache_dir')})")
    m.add_argument("--cache-size", default=unset,
                   help=f"disk budget for the cache dir (default {_size_default('cache_size')})")
    m.add_argument("--memory-cache-size", default=unset,
                   help=f"memory block cache (default {_size_default('memory_cache_size')})")
    m.add_argument("--max-dirty", default=unset,
                   help="bound on data not yet in the bucket (default: cache-size/4, at most 2GiB)")
    m.add_argument("--block-size", default=unset,
                   help=f"block size of a new volume (default {format_size(DEFAULT_BLOCK_SIZE).replace(' ', '')}); "
                        "an existing volume keeps its own")
    m.add_argument("--durability", choices=["remote", "local"], default=unset,
                   help=f"what fsync waits for (default {_default('durability')})")
    m.add_argument("--upload-delay", type=float, default=unset,
                   help=f"seconds a block waits before upload (default {_default('upload_delay')})")
    m.add_argument("--upload-concurrency", type=int, default=unset,
                   help=f"parallel uploads (default {_default('upload_concurrency')})")
    m.add_argument("--readahead", type=int, default=unset, dest="readahead_blocks",
                   help=f"blocks read ahead on sequential reads (default {_default('readahead_blocks')})")
    m.add_argument("--kernel-readahead", default=unset,
                   help="the kernel's read-ahead window for the mount, up to FUSE's 1M requests; "
                        f"0 keeps the kernel's 128K (default {_size_default('kernel_readahead')})")
    m.add_argument("--endpoint-url", default=unset, help="S3-compatible or GCS emulator endpoint")
    m.add_argument("--metrics-addr", default=unset,
                   help="HOST:PORT of the Prometheus exporter, or 'off'; a port taken fails the mount (default: "
                        f"127.0.0.1:{DEFAULT_METRICS_PORT}, or the next free port up to "
                        f"{DEFAULT_METRICS_PORT + METRICS_PORTS - 1}, so each mount of a node has its own)")
    m.add_argument("--allow-other", action="store_true", default=unset, help="let other users use the mount")
    m.add_argument("--read-only", action="store_true", default=unset)
    m.add_argument("--takeover", action="store_true", default=unset, help="take the volume over from a dead holder")
    m.add_argument("--prefetch", nargs="?", const="all", default=unset, choices=PREFETCH_MODES,
                   help="after mounting, fetch blocks into the disk cache in the background: 'recent' "
                        "the most recently modified files first, up to half the disk cache; "
                        "'all' (or the bare flag) as much of the volume as 90%% of the disk cache holds; "
                        "'off' only on demand; 'auto' (default) is 'recent' for s3:// and gs:// and "
                        "'off' for a file:// bucket, which is no slower to read than the cache")
    m.add_argument("--prefetch-links", default=unset, choices=PREFETCH_LINK_MODES,
                   help="a file hard-linked on this node whose blocks the node does not hold (a Spark "
                        "state store loaded from its checkpoint) is fetched in the background into the "
                        "kernel's page cache, so its reads skip the daemon: 'lazy' (default) first what "
                        "opening it reads (a RocksDB table's index, filters and footer; other files whole), "
                        "then its data blocks while no read waits for the bucket; 'tails' only the first "
                        "part; 'whole' (or 'on') each file from its start; 'off' none")
    m.add_argument("--page-fill-budget", default=unset,
                   help="bytes of linked files queued for the page cache at once; a link beyond it is "
                        "not filled, a requested file (spark-fill, the fill attribute) waits, up to twice "
                        "the budget (default: a quarter of the memory, at most 8G)")
    m.add_argument("--whole-blocks", default=unset, choices=WHOLE_BLOCK_MODES,
                   help="cold reads bring whole blocks to this node (scans and their readahead, blocks "
                        "small reads come back to) instead of reading only their range: 'auto' (default) "
                        "while a small range read from the bucket costs at least 4 times one from local "
                        "disk (S3, GCS; not a file:// bucket on a disk like the cache's), 'always', or "
                        "'never'")
    m.add_argument("--scratch", action="append", default=unset, metavar="PATTERN", dest="scratch_dirs",
                   help="directories created with a name matching this glob, and all they hold, stay on this "
                        "node: not uploaded (but for --store-ahead's files), emptied at the next mount (on a shared volume: when the mount "
                        "ends; the other nodes see the names, cannot open the files); for Spark's shuffle dirs: "
                        "--scratch 'blockmgr-*'; repeatable")
    m.add_argument("--store-ahead", action="append", default=unset, metavar="PATTERN", dest="store_ahead",
                   help="scratch files (--scratch) named to match this glob have their blocks stored while they "
                        "are written and when closed, so that linking them into the volume (a state store's "
                        "commit) finds them done (default: '*.sst', RocksDB's tables; 'none' turns it off); "
                        "repeatable")
    m.add_argument("--journal-interval", type=float, default=unset,
                   help="seconds between metadata journal shipments; fsync ships at once "
                        f"(default {_default('journal_interval')})")
    m.add_argument("--gc-grace", type=float, default=unset,
                   help=f"seconds an unreferenced block is kept before deletion (default {_default('gc_grace')})")
    _add_meta_argument(m)
    m.add_argument("--session-timeout", type=float, default=unset,
                   help="with --meta: seconds a node's session lives without a heartbeat before the other "
                        f"nodes clean it up (default {_default('session_timeout')})")
    m.add_argument("--meta-outage-budget", type=float, default=unset, metavar="SECONDS",
                   help="with --meta: how long an operation waits for the database (a restart, a failover to a "
                        "standby), or an fsync for a synchronous standby's confirmation, before it fails with EIO "
                        f"(default {_default('meta_outage_budget'):g})")
    m.add_argument("--meta-connections", type=int, default=unset, metavar="N",
                   help="with --meta: the most connections this daemon opens to the database, made as "
                        f"operations need them and kept (default {_default('meta_connections')})")
    m.add_argument("--meta-pooler", choices=("none", "session", "transaction"), default=unset,
                   help="with --meta: the connection pooler between this daemon and the database, if any; "
                        "'transaction' (PgBouncer's pool_mode = transaction) runs every statement unprepared "
                        f"(default {_default('meta_pooler')})")
    m.add_argument("--inline-max", type=int, default=unset, metavar="BYTES",
                   help="with --meta: a file of at most this size keeps its bytes in the database, not the "
                        f"bucket: its close is one transaction, no upload (0: off; default {_default('inline_max')})")
    m.add_argument("--lookup-cache", choices=("on", "off"), default=unset,
                   help="with --meta: answer lookups and attributes of names and files no node changed from this "
                        "node's memory while the database's change notifications reach it (off: every lookup asks "
                        f"the database; default {_default('lookup_cache')})")
    m.add_argument("--foreground", "-f", action="store_true", default=unset, help="stay in the foreground")
    m.add_argument("--attr-timeout", type=float, default=unset,
                   help="seconds the kernel caches names and attributes (default 10, or 1 with --meta: "
                        "how long another node's rename or unlink may go unseen)")
    m.add_argument("--read-trace", default=unset, metavar="FILE",
                   help="diagnostics: append a JSON line to FILE for every read the daemon answers, every "
                        "read from the bucket and every page fill (docs/operations.md); off by default")
    m.add_argument("--debug", action="store_true", default=unset, help="verbose logging")
    m.add_argument("-o", dest="fuse_options", action="append", default=unset, help="extra FUSE mount option")
    m.add_argument("--frontend", choices=FRONTENDS, default=unset,
                   help="what speaks to the kernel: 'pyfuse3' (libfuse); 'native' (the fusestate_kernel "
                        "extension, with the kernel's writeback cache); 'passthrough' (the extension, with "
                        "files written here, scratch files and their readers served by the kernel from "
                        "local files: FUSE passthrough, Linux 6.9+ and root); 'auto' (default; the "
                        "environment's FUSESTATE_FRONTEND when set)")


SIZE_OPTIONS = {"cache_size": "--cache-size", "memory_cache_size": "--memory-cache-size",
                "max_dirty": "--max-dirty", "block_size": "--block-size", "kernel_readahead": "--kernel-readahead",
                "page_fill_budget": "--page-fill-budget"}


def _mount_config(args: argparse.Namespace) -> MountConfig:
    given = {name: value for name, value in vars(args).items() if name not in ("command", "meta")}
    for name, option in SIZE_OPTIONS.items():
        if name in given:
            given[name] = parse_size(given[name], option)
    return MountConfig(meta_url=args.meta, **given)


def _setup_logging(debug: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("botocore", "s3fs", "aiobotocore", "gcsfs", "urllib3", "fsspec"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def cmd_mount(args: argparse.Namespace) -> int:
    cfg = _mount_config(args)
    if cfg.foreground:
        from fusestate.daemon.mount import run_foreground

        _setup_logging(cfg.debug)
        ready_fd = int(os.environ.pop(READY_FD_ENV)) if READY_FD_ENV in os.environ else None
        try:
            run_foreground(cfg, ready_fd)
        except UserError as exc:
            if ready_fd is not None:
                try:
                    os.write(ready_fd, f"error: {exc}\n".encode())
                except OSError:
                    pass
            raise
        return 0
    return _spawn_daemon(cfg, args)


def _spawn_daemon(cfg: MountConfig, args: argparse.Namespace) -> int:
    """Start the daemon in the background; return once the mount answers (or failed)."""
    from fusestate.daemon.paths import check_mountpoint, prepare_cache_dir

    check_mountpoint(cfg.mountpoint)
    layout = prepare_cache_dir(cfg.cache_dir)
    read_fd, write_fd = os.pipe()
    argv = [sys.executable, "-P", "-m", "fusestate"] + _argv_without_background(sys.argv[1:]) + ["--foreground"]
    env = dict(os.environ, **{READY_FD_ENV: str(write_fd)})
    with open(layout.log, "ab") as log_file:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                                pass_fds=[write_fd], env=env, start_new_session=True)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        message = pipe.read().decode(errors="replace").strip()
    if message.startswith("ready"):
        return 0
    if message.startswith("error: "):
        raise UserError(message[len("error: "):])
    code = proc.wait()
    raise UserError(f"the daemon exited with status {code} before the mount was ready; see {layout.log}")


def _argv_without_background(argv: Sequence[str]) -> list[str]:
    return [a for a in argv if a not in ("--foreground", "-f")]


def cmd_umount(args: argparse.Namespace) -> int:
    from fusestate.daemon import control
    from fusestate.daemon.paths import control_socket

    mountpoint = os.path.abspath(args.mountpoint)
    path = control_socket(mountpoint)
    if not os.path.exists(path):
        if os.path.ismount(mountpoint):
            raise UserError(f"{mountpoint} is not served by a running fusestate daemon")
        raise UserError(f"{mountpoint} is not a fusestate mount")
    reply = control.request(path, {"command": "umount"}, timeout=args.timeout)
    if not reply.get("ok"):
        raise UserError(reply.get("error", "unmount failed"))
    return 0


def _fetch_status(mountpoint: str) -> dict:
    from fusestate.daemon.control import fetch_status

    return fetch_status(mountpoint)


def cmd_stats(args: argparse.Namespace) -> int:
    import time

    previous, shown = _fetch_status(args.mountpoint), 0
    clear = "\033[H\033[2J" if sys.stdout.isatty() else ""
    while not args.count or shown < args.count:
        time.sleep(args.interval)
        current = _fetch_status(args.mountpoint)
        print(clear + _stats_table(previous, current, args.interval), flush=True)
        previous, shown = current, shown + 1
    return 0


def _stats_table(before: dict, after: dict, seconds: float) -> str:
    def rate(section: str, key: str) -> float:
        return (after[section][key] - before[section][key]) / seconds

    cache = after["cache"]
    hits = cache["memory_hits"] - before["cache"]["memory_hits"] + cache["disk_hits"] - before["cache"]["disk_hits"]
    misses = cache["disk_misses"] - before["cache"]["disk_misses"]
    ratio = f"{100 * hits / (hits + misses):.1f}%" if hits + misses else "-"
    wb, meta = after["writeback"], after["metadata"]
    rows = [
        ("fuse ops/s", f"{rate('fuse', 'operations'):.0f}"),
        ("read / written", f"{format_size(rate('fuse', 'bytes_read'))}/s / {format_size(rate('fuse', 'bytes_written'))}/s"),
        ("cache hit ratio", ratio),
        ("uploaded", f"{format_size(rate('writeback', 'uploaded_bytes'))}/s"),
        ("bucket in / out", f"{format_size(rate('remote', 'bytes_in'))}/s / {format_size(rate('remote', 'bytes_out'))}/s"),
        ("dirty", f"{format_size(wb['dirty_bytes'])} of {format_size(wb['max_dirty'])}"),
        ("staged / queue", f"{wb['staged_blocks']} blocks / {wb['upload_queue']}, oldest {wb['oldest_staged_seconds']} s"),
        ("journal pending", f"{meta['journal_pending']} entries, shipped seq {meta['shipped_seq']}"
                            if "journal_pending" in meta else f"none: the namespace is in {meta['engine']}"),
        ("backpressure", f"{wb['backpressure_waits']} waits, {wb['backpressure_seconds']} s"),
    ]
    width = max(len(k) for k, _ in rows)
    head = f"fusestate {after['mountpoint']}  ({after['url']})"
    return "\n".join([head] + [f"{k:<{width}}  {v}" for k, v in rows])


def cmd_status(args: argparse.Namespace) -> int:
    if args.warm is not None:
        return _print_warm(args)
    status = _fetch_status(args.mountpoint)
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        _print_status(status)
    lost = _session_state(status) == "lost" or status.get("lease", {}).get("state") == "lost"
    return STATUS_SESSION_LOST if lost else 0


def _session_state(status: dict) -> Optional[str]:
    """live, lost or read-only on a shared volume; None on the embedded engine."""
    return status.get("session", {}).get("state")


def _print_warm(args: argparse.Namespace) -> int:
    from fusestate.daemon import control
    from fusestate.daemon.paths import control_socket

    mountpoint = os.path.abspath(args.mountpoint)
    path = os.path.abspath(os.path.join(mountpoint, args.warm))
    if os.path.commonpath([path, mountpoint]) != mountpoint:
        raise UserError(f"{args.warm} is not under the mount {mountpoint}")
    socket_path = control_socket(mountpoint)
    if not os.path.exists(socket_path):
        raise UserError(f"{mountpoint} is not a fusestate mount")
    reply = control.request(socket_path, {"command": "warm", "path": os.path.relpath(path, mountpoint).lstrip(".")},
                            timeout=600)
    if not reply.get("ok"):
        raise UserError(reply.get("error", "status --warm failed"))
    warm = reply["warm"]
    if args.json:
        print(json.dumps(warm, indent=2, sort_keys=True))
        return 0
    dirs = warm["dirs"]
    width = max([len(d["path"]) for d in dirs] + [9])
    print(f"{'directory':<{width}}  {'warm files':>12}  {'warm bytes':>21}  {'warm':>5}")
    for d in dirs:
        share = f"{100 * d['warm_bytes'] / d['bytes']:.0f}%" if d["bytes"] else "-"
        print(f"{d['path']:<{width}}  {d['warm_files']:>5} of {d['files']:<5}  "
              f"{format_size(d['warm_bytes']):>9} of {format_size(d['bytes']):<9}  {share:>5}")
    total, held = sum(d["bytes"] for d in dirs), sum(d["warm_bytes"] for d in dirs)
    print(f"{warm['files_seen']} files, {format_size(held)} of {format_size(total)} warm on this node"
          + (" (stopped at the walk's file limit)" if warm["truncated"] else ""))
    return 0


def _print_status(status: dict) -> None:
    cache, wb, remote = status["cache"], status["writeback"], status["remote"]
    session = status.get("session")
    if session and session["state"] == "lost":
        print(f"SESSION LOST: the other nodes cleaned up this mount's metadata session {session['id']} (no "
              f"heartbeat within {session['timeout_seconds']:g} s); it publishes nothing more: creates, opens, "
              f"and closes and fsyncs of written files fail with EIO. Unmount it "
              f"(fusestate umount {status['mountpoint']}) and mount it again.")
    if session and session.get("standby_wait_seconds"):
        print(f"WAITING FOR A SYNCHRONOUS STANDBY: the metadata database has held this node's durable commits "
              f"(fsync) for {session['standby_wait_seconds']:g} s, waiting for a standby to confirm them "
              f"(synchronous_standby_names = '{session['standby_names']}'); each fails with EIO after "
              f"{session['outage_budget_seconds']:g} s. A primary with no standby of its own must not name one "
              f"(a promoted standby keeps the setting): clear it there, or bring a standby back.")
    if status.get("lease", {}).get("state") == "lost":
        print(f"LEASE LOST: another mount took the volume over (--takeover); this mount publishes nothing "
              f"more. Unmount it (fusestate umount {status['mountpoint']}).")
    rows = [
        ("volume", f"{status['url']} on {status['mountpoint']} (pid {status['pid']})"),
    ]
    if session:
        live = sum(1 for s in status.get("sessions", []) if "id" in s)
        mine = "none (read-only)" if session["state"] == "read-only" else f"{session['id']}, {session['state']}"
        rows.append(("session", f"{mine}; {live} live sessions on the volume"))
        if "lookup_cache_hits" in session:
            followed = "following other nodes' changes" if session.get("changes_followed") else "not in use"
            rows.append(("lookup cache", f"{followed}; {session['lookup_cache_hits']} hits, "
                                         f"{session['lookup_cache_misses']} misses"))
    rows += [
        ("files / used", f"{status['files']} / {format_size(status['used_bytes'])}"),
        ("memory cache", f"{format_size(cache['memory_bytes'])} of {format_size(cache['memory_limit'])}, "
                         f"{cache['memory_hits']} hits, {cache['memory_misses']} misses"),
        ("disk cache", f"{format_size(cache['disk_bytes'])} of {format_size(cache['disk_limit'])}, "
                       f"{cache['disk_hits']} hits, {cache['disk_misses']} misses; "
                       f"{format_size(cache['cache_dir_free_bytes'])} free on the cache disk"
                       + (f"; {cache['disk_full_failures']} blocks refused, disk full" if cache.get("disk_full_failures")
                          else "")),
        ("dirty", f"{format_size(wb['dirty_bytes'])} of {format_size(wb['max_dirty'])}"),
        ("staged", f"{wb['staged_blocks']} blocks, {format_size(wb['staged_bytes'])}, "
                   f"oldest {wb['oldest_staged_seconds']} s, queue {wb['upload_queue']}"),
        ("uploaded", f"{wb['uploaded_blocks']} blocks, {format_size(wb['uploaded_bytes'])}, "
                     f"{wb['dedup_skipped']} skipped by dedup, {wb['upload_failures']} failures; "
                     f"{wb.get('deduplicated_blocks', 0)} written blocks ({format_size(wb.get('deduplicated_bytes', 0))}) "
                     f"the volume already had"),
        ("scratch", f"{cache['scratch_files']} files, {format_size(cache['scratch_bytes'])} on the cache disk "
                    f"({', '.join(status['scratch_dirs']) or 'no --scratch'}); {cache['promoted_files']} linked "
                    f"into the volume ({format_size(cache['promoted_bytes'])}); "
                    f"{cache.get('stored_ahead_blocks', 0)} blocks stored ahead of a link, "
                    f"{cache.get('stored_ahead_used', 0)} used, {cache.get('stored_ahead_abandoned', 0)} let go, "
                    f"{cache.get('unread_promotions', 0)} links read nothing"),
        ("remote", f"{format_size(remote['bytes_in'])} in, {format_size(remote['bytes_out'])} out, "
                   f"{remote['retries']} retries"),
        ("metrics", f"http://{status['metrics_addr']}/metrics" if status["metrics_addr"] else "off"),
    ]
    small = remote.get("small_read_ms")
    if small and small["bucket"] is not None:
        local = f"{small['local']} ms" if small["local"] is not None else "not measured yet"
        rows.append(("small reads", f"{small['bucket']} ms from the bucket, {local} locally: "
                                    + ("cold reads fetch whole blocks" if small["whole_blocks"]
                                       else "cold reads are range reads")))
    warm = status.get("warmup")
    if warm and warm["mode"] != "off":
        rows.append(("warmup", f"{warm['state']} ({warm['mode']}), {format_size(warm['fetched_bytes'])} fetched "
                               f"of a {format_size(warm['budget_bytes'])} budget in {warm['seconds']} s"))
    fill = status.get("page_fill")
    if fill and fill.get("mode", "off") != "off" and (fill["bytes"] or fill["pending_bytes"]):
        rows.append(("page fill", f"{fill['mode']}: {format_size(fill['bytes'])} filled, "
                                  f"{format_size(fill['first_bytes'])} first ({fill['tables']} tables' tails, "
                                  f"other files whole), {format_size(fill['body_bytes'])} data blocks; "
                                  f"{format_size(fill['pending_bytes'])} pending"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def cmd_warmup(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from fusestate.daemon import control
    from fusestate.daemon.paths import control_socket

    by_mount: dict[str, list[int]] = {}
    for path in args.paths:
        if not os.path.exists(path):
            raise UserError(f"{path} does not exist")
        mount = _mount_of(os.path.abspath(path))
        for root, _, files in os.walk(path) if os.path.isdir(path) else [(os.path.dirname(path), [], [os.path.basename(path)])]:
            for name in files:
                by_mount.setdefault(mount, []).append(os.stat(os.path.join(root, name)).st_ino)
    for mount, inodes in by_mount.items():
        with tqdm(total=len(inodes), unit="file", desc=f"warmup {mount}") as bar:
            fetched = 0
            for start in range(0, len(inodes), 64):
                batch = inodes[start:start + 64]
                reply = control.request(control_socket(mount), {"command": "warmup", "inodes": batch}, timeout=None)
                if not reply.get("ok"):
                    raise UserError(reply.get("error", "warmup failed"))
                fetched += reply["fetched"]
                bar.update(len(batch))
        print(f"{mount}: {len(inodes)} files warm, {fetched} blocks fetched")
    return 0


def cmd_fsck(args: argparse.Namespace) -> int:
    from fusestate.maintenance import fsck

    report = fsck(args.url, args.endpoint_url, verify=not args.quick, all_restore_points=args.all_restore_points,
                  meta_url=meta_url_of(args.meta))
    if args.json:
        print(json.dumps({"healthy": report.healthy, "engine": report.engine, "seq": report.seq,
                          "referenced": report.referenced, "problems": report.problems,
                          "stored": report.stored, "missing": report.missing, "corrupt": report.corrupt,
                          "unreferenced": report.unreferenced, "restore_points": report.restore_points,
                          "broken_restore_points": report.broken_restore_points}, indent=2))
    else:
        where = f"journal sequence {report.seq}" if report.engine == "sqlite" else report.engine
        print(f"metadata ({where}): {report.referenced} blocks referenced, {report.stored} blocks in the bucket")
        for problem in report.problems:
            print(f"PROBLEM  {problem}")
        for key in report.missing:
            print(f"MISSING  {key}")
        for key in report.corrupt:
            print(f"CORRUPT  {key}")
        if args.all_restore_points:
            print(f"{report.restore_points} restore points checked, "
                  f"{len(report.broken_restore_points)} reference missing blocks")
        print(f"{len(report.unreferenced)} unreferenced blocks (garbage until `fusestate gc`)")
        print("volume is healthy" if report.healthy else "volume is DAMAGED")
    return 0 if report.healthy else 1


def cmd_gc(args: argparse.Namespace) -> int:
    from fusestate.maintenance import gc

    report = gc(args.url, args.endpoint_url, grace=args.grace, dry_run=args.dry_run, force=args.force,
                meta_url=meta_url_of(args.meta))
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {len(report.deleted)} unreferenced blocks; kept {report.kept_young} younger than "
          f"the grace period; {report.referenced} blocks referenced")
    return 0


def _mount_of(path: str) -> str:
    while not os.path.ismount(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def cmd_spark_fill(args: argparse.Namespace) -> int:
    import time

    from fusestate.daemon import control
    from fusestate.spark.config import checkpoint_path
    from fusestate.spark.snapshot_fill import fill_latest_snapshot

    _, path = checkpoint_path(args.checkpoint)
    if not path.is_dir():
        raise UserError(f"{path} is not a directory")
    mount = _mount_of(str(path.resolve()))
    found = fill_latest_snapshot(path, mount)
    print(f"{mount}: {found.queued} files ({format_size(found.queued_bytes)}) of {found.stores} state stores' "
          f"latest snapshot queued for the page cache ({found.files} found, {format_size(found.bytes)})", flush=True)
    try:
        while args.wait and found.queued and control.fetch_status(mount)["page_fill"]["pending_bytes"] > 0:
            time.sleep(0.5)
    finally:
        found.release()
    return 0


def cmd_spark_pipeline(args: argparse.Namespace) -> int:
    from fusestate.spark.pipeline import run as run_spark_pipeline

    run_spark_pipeline(args)
    return 0


def cmd_spark_cluster(args: argparse.Namespace) -> int:
    from fusestate.spark.cluster import run as run_spark_cluster

    run_spark_cluster(args)
    return 0


COMMANDS = {"mount": cmd_mount, "umount": cmd_umount, "status": cmd_status, "warmup": cmd_warmup,
            "fsck": cmd_fsck, "gc": cmd_gc, "stats": cmd_stats, "spark-fill": cmd_spark_fill,
            "spark-pipeline": cmd_spark_pipeline,
            "spark-cluster": cmd_spark_cluster}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except UserError as exc:
        print(f"fusestate: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
