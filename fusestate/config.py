"""Mount options with their defaults, shared by the CLI, the daemon and the docs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import humanfriendly

from fusestate.errors import UserError

MiB = 1 << 20
GiB = 1 << 30

DEFAULT_BLOCK_SIZE = 4 * MiB
FRONTENDS = ("auto", "pyfuse3", "native", "passthrough")  # what speaks to the kernel (fusestate.fuse.frontend)
PREFETCH_MODES = ("auto", "off", "recent", "all")  # cache warming after the mount (--prefetch)
WHOLE_BLOCK_MODES = ("auto", "always", "never")  # cold reads fetch whole blocks (--whole-blocks)
# Files linked here go to the page cache (--prefetch-links); "on" is the earlier name of "whole".
PREFETCH_LINK_MODES = ("lazy", "tails", "whole", "on", "off")
DEFAULT_CACHE_DIR = "/var/cache/fusestate"
DEFAULT_METRICS_PORT = 9567
METRICS_PORTS = 10  # without --metrics-addr: 127.0.0.1 on the first free port of 9567-9576


def parse_size(text: str, option: str = "size") -> int:
    """'20G', '512M', '4MiB' or a byte count; binary units (G = GiB)."""
    try:
        return int(humanfriendly.parse_size(text, binary=True))
    except humanfriendly.InvalidSize:
        raise UserError(f"bad {option} {text!r}: expected a size such as 512M or 20G") from None


def redact_url(url: str) -> str:
    """A URL without its password (in its user part or, as libpq also takes it, in a
    ``password=`` parameter), for every message and record. Works on a libpq multi-host
    URL (``postgresql://u:pw@h1:5432,h2:5432/db``): only the part before ``@`` is read."""
    import re
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.query:
        parts = parts._replace(query=re.sub(r"(^|&)password=[^&]*", r"\1password=***", parts.query))
    if parts.password is not None:
        host = parts.netloc.rsplit("@", 1)[1]
        parts = parts._replace(netloc=f"{parts.username}:***@{host}" if parts.username else host)
    return urlunsplit(parts)


def format_size(n: float) -> str:
    return humanfriendly.format_size(n, binary=True)


def default_prefetch(url: str) -> str:
    """What ``--prefetch auto`` means for a bucket: ``off`` for a ``file://`` bucket, whose
    blocks cost a read of the same kind of local disk as the cache (warming then only doubles
    the disk traffic while the job starts: a Spark restart took 4-8 s longer with it), and
    ``recent`` for an object store, where every fetch is a network round trip (``memory://``,
    for tests, is local too)."""
    from fusestate.remote.backends import parse_url  # fsspec: only mounts pay for its import

    return "off" if parse_url(url).scheme in ("file", "memory") else "recent"


def parse_metrics_addr(addr: str) -> tuple[str, int]:
    """--metrics-addr HOST:PORT (HOST defaults to 127.0.0.1) as (host, port)."""
    host, _, port = addr.rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        raise UserError(f"bad --metrics-addr {addr!r}: expected HOST:PORT, such as 0.0.0.0:{DEFAULT_METRICS_PORT}, "
                        "or off")
    return host.strip("[]") or "127.0.0.1", int(port)


def meta_url_of(meta: Optional[str]) -> Optional[str]:
    """--meta as given: None for the embedded engine, else a PostgreSQL URL (checked)."""
    if meta in (None, "", "sqlite"):
        return None
    if not meta.startswith(("postgresql://", "postgres://")):
        raise UserError(f"bad --meta {redact_url(meta)!r}: expected "
                        "postgresql://[user@]host[:port][,host2[:port]...]/database or sqlite (the embedded default)")
    return meta


@dataclass
class MountConfig:
    url: str
    mountpoint: str
    cache_dir: str = DEFAULT_CACHE_DIR
    cache_size: int = 20 * GiB
    memory_cache_size: int = 512 * MiB
    max_dirty: Optional[int] = None          # default: a quarter of cache_size, at most 2 GiB
    block_size: Optional[int] = None         # a new volume's; default 4 MiB. An existing volume keeps its own
    durability: str = "remote"               # remote | local
    upload_delay: float = 1.0                # seconds a sealed block waits before upload
    upload_concurrency: int = 8
    readahead_blocks: int = 2
    kernel_readahead: int = 1 * MiB          # the kernel's read-ahead window for the mount; 0 keeps its own
    endpoint_url: Optional[str] = None
    allow_other: bool = False
    read_only: bool = False
    takeover: bool = False
    foreground: bool = False
    metrics_addr: Optional[str] = None       # HOST:PORT or "off"; None: the first free port of METRICS_PORTS
    attr_timeout: Optional[float] = None     # default: 10 s, 1 s for a shared engine
    remote_timeout: float = 30.0
    remote_retries: int = 6
    gc_grace: float = 3600.0                 # seconds an unreferenced block is kept
    gc_interval: float = 300.0               # seconds between garbage collection passes
    journal_interval: float = 2.0            # seconds between journal shipments (fsync ships at once)
    lease_ttl: float = 30.0                  # seconds a lease stays valid without a heartbeat
    prefetch: str = "auto"                   # auto | off | recent | all: background cache warming after mounting
    prefetch_links: str = "lazy"             # lazy | tails | whole | off: files linked here go to the page cache
    page_fill_budget: Optional[int] = None   # bytes queued for the page cache at once; None: a quarter of memory, <= 8 GiB
    whole_blocks: str = "auto"               # auto | always | never: cold reads bring whole blocks to the node
    read_trace: Optional[str] = None         # diagnostics: a JSON line per read, bucket read and page fill
    scratch_dirs: list[str] = field(default_factory=list)  # name globs of node-local directories (--scratch)
    # name globs of scratch files whose blocks are stored before they are linked out (--store-ahead)
    store_ahead: list[str] = field(default_factory=lambda: ["*.sst"])
    meta_url: Optional[str] = None           # a shared metadata engine (postgresql://...); None: embedded SQLite
    session_timeout: float = 30.0            # shared engine: seconds without a heartbeat before others clean up
    meta_outage_budget: float = 60.0         # shared engine: seconds an operation waits for the database (EIO after)
    meta_connections: int = 8                # shared engine: most connections this daemon opens to the database
    meta_pooler: str = "none"                # shared engine: "transaction" behind PgBouncer's transaction mode
    inline_max: int = 4096                   # shared engine: files up to this size keep their bytes in the database
    lookup_cache: str = "on"                 # shared engine: on | off: lookups answered here while change notifications flow
    debug: bool = False
    fuse_options: list[str] = field(default_factory=list)
    # auto | pyfuse3 | native | passthrough: what speaks to the kernel; the environment's FUSESTATE_FRONTEND when not given
    frontend: str = field(default_factory=lambda: os.environ.get("FUSESTATE_FRONTEND") or "auto")

    def __post_init__(self) -> None:
        self.mountpoint = os.path.abspath(self.mountpoint)
        self.meta_url = meta_url_of(self.meta_url)
        if self.attr_timeout is None:
            self.attr_timeout = 1.0 if self.meta_url else 10.0
        if self.meta_outage_budget <= 0:
            raise UserError(f"bad --meta-outage-budget {self.meta_outage_budget:g}: expected seconds, more than 0")
        if self.meta_connections < 2:
            raise UserError(f"bad --meta-connections {self.meta_connections}: expected 2 or more")
        if not 0 <= self.inline_max <= 8192:
            raise UserError(f"bad --inline-max {self.inline_max}: expected 0 (off) to 8192 bytes")
        if self.lookup_cache not in ("on", "off"):
            raise UserError(f"bad --lookup-cache {self.lookup_cache!r}: expected on or off")
        if self.meta_pooler not in ("none", "session", "transaction"):
            raise UserError(f"bad --meta-pooler {self.meta_pooler!r}: expected none, session or transaction")
        if self.meta_url is not None:
            if self.takeover:
                raise UserError("--takeover is for the embedded engine's single writer; with --meta every node "
                                "mounts read-write at once")
        self.cache_dir = os.path.abspath(self.cache_dir)
        if self.read_trace:
            self.read_trace = os.path.abspath(self.read_trace)  # the daemon runs from /
        if self.durability not in ("remote", "local"):
            raise UserError(f"bad --durability {self.durability!r}: expected remote or local")
        if self.prefetch not in PREFETCH_MODES:
            raise UserError(f"bad --prefetch {self.prefetch!r}: expected auto, off, recent or all")
        if self.prefetch == "auto":
            self.prefetch = default_prefetch(self.url)
        if self.prefetch_links not in PREFETCH_LINK_MODES:
            raise UserError(f"bad --prefetch-links {self.prefetch_links!r}: expected lazy, tails, whole or off")
        if self.prefetch_links == "on":
            self.prefetch_links = "whole"
        if self.page_fill_budget is not None and self.page_fill_budget <= 0:
            raise UserError(f"bad --page-fill-budget {self.page_fill_budget}: expected a size such as 4G, more than 0")
        if self.whole_blocks not in WHOLE_BLOCK_MODES:
            raise UserError(f"bad --whole-blocks {self.whole_blocks!r}: expected auto, always or never")
        for pattern in self.scratch_dirs:
            if not pattern or "/" in pattern or pattern in ("*", ".", ".."):
                raise UserError(f"bad --scratch {pattern!r}: expected a directory name pattern such as 'blockmgr-*'")
        if self.store_ahead == ["none"]:
            self.store_ahead = []
        for pattern in self.store_ahead:
            if not pattern or "/" in pattern:
                raise UserError(f"bad --store-ahead {pattern!r}: expected a file name pattern such as '*.sst', or none")
        if self.metrics_addr not in (None, "off"):
            parse_metrics_addr(self.metrics_addr)
        if self.frontend not in FRONTENDS:
            raise UserError(f"bad --frontend {self.frontend!r}: expected one of {', '.join(FRONTENDS)}")
        if self.block_size is not None and (self.block_size < 64 * 1024 or self.block_size & (self.block_size - 1)):
            raise UserError("--block-size must be a power of two of at least 64K")
        if self.max_dirty is None:
            self.max_dirty = min(2 * GiB, max(self.cache_size // 4, 4 * self.sizing_block_size))
        self._require_room(f"--cache-size {format_size(self.cache_size)}")

    def _require_room(self, what: str, advice: str = "") -> None:
        assert self.max_dirty is not None
        if self.cache_size < self.max_dirty + 4 * self.sizing_block_size:
            raise UserError(f"{what} is too small: it must hold --max-dirty ({format_size(self.max_dirty)}) "
                            f"plus a few blocks{advice}")

    def fit_cache_size(self, room: int) -> None:
        """Shrink the cache to the ``room`` its disk really has (staging and read cache alike)."""
        if room < self.cache_size:
            self.cache_size = room
            assert self.max_dirty is not None
            self.max_dirty = min(self.max_dirty, max(room // 4, 4 * self.sizing_block_size))
        self._require_room(f"the room on the cache dir's disk ({format_size(max(room, 0))})",
                           "; free some space or choose another --cache-dir")

    @property
    def sizing_block_size(self) -> int:
        """The block size the cache budget is checked against before the volume is read."""
        return self.block_size or DEFAULT_BLOCK_SIZE

    @property
    def read_cache_size(self) -> int:
        """Disk read cache budget: what the staging area (max_dirty) leaves of cache_size."""
        assert self.max_dirty is not None
        return self.cache_size - self.max_dirty
