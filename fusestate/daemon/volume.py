"""A volume in the bucket and its descriptor.

Layout under the volume's root::

    fusestate.json              format version, block size, volume id, metadata engine
    blocks/ab/<hash>            content-addressed blocks (BLAKE3; SHA-256 before), never overwritten
    lease/<epoch>.json          one per read-write mount: holder, heartbeat, fencing
    meta/journal/...            metadata journal segments (see fusestate.meta.embedded.journal)
    meta/snapshot-...db         compacted metadata snapshots
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Optional

from fusestate.config import DEFAULT_BLOCK_SIZE
from fusestate.errors import UserError
from fusestate.remote.store import RemoteError, RemoteStore

log = logging.getLogger(__name__)

DESCRIPTOR = "fusestate.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class VolumeInfo:
    volume_id: str
    block_size: int
    format: int
    meta: str = "sqlite"      # where the metadata lives: "sqlite" or postgresql://host:port/database


def engine_identity(meta_url: Optional[str]) -> str:
    """The database a volume's metadata lives in, as recorded: no user, no password, no
    options. A libpq multi-host URL (a primary and its standbys) records every server, in
    order: ``postgresql://h1:5432,h2:5432/db``. libpq's own parser reads the URL."""
    if not meta_url:
        return "sqlite"
    servers, database = _servers(meta_url)
    return f"postgresql://{','.join(servers)}/{database}"


def _servers(meta_url: str) -> tuple[list[str], str]:
    """(["host:port", ...], database) of a PostgreSQL URL, defaults filled in as libpq does."""
    from psycopg.conninfo import conninfo_to_dict  # only a shared volume pays for psycopg's import

    try:
        params = conninfo_to_dict(meta_url)
    except Exception as exc:  # noqa: BLE001 - psycopg.ProgrammingError: libpq's own words
        raise UserError(f"bad --meta URL: {str(exc).strip() or type(exc).__name__}") from None
    hosts = str(params.get("host") or "localhost").split(",")
    ports = str(params.get("port") or "5432").split(",")
    if len(ports) == 1:
        ports *= len(hosts)  # one port for every host, as libpq reads it
    if len(ports) != len(hosts):
        raise UserError(f"bad --meta URL: {len(hosts)} hosts but {len(ports)} ports")
    servers = [f"{h or 'localhost'}:{p or 5432}" for h, p in zip(hosts, ports)]
    return servers, str(params.get("dbname") or "")


def _same_database(recorded: str, named: str) -> bool:
    """Whether ``named`` reaches the database ``recorded``: the same database name on at
    least one of the same servers. A volume created through one server of a cluster (or
    through the whole list) is mounted through any list that still names one of them."""
    if not (recorded.startswith("postgresql://") and named.startswith("postgresql://")):
        return False
    (rec_servers, rec_db), (servers, db) = _servers(recorded), _servers(named)
    return rec_db == db and bool(set(rec_servers) & set(servers))


def _check_engine(info: VolumeInfo, meta_url: Optional[str]) -> None:
    named = engine_identity(meta_url)
    if named == info.meta or _same_database(info.meta, named):
        return
    if info.meta == "sqlite":
        raise UserError(f"the volume keeps its metadata in the embedded engine (sqlite), not {named}; "
                        "mount it without --meta")
    if named == "sqlite":
        raise UserError(f"the volume keeps its metadata in {info.meta}; mount it with --meta {info.meta} "
                        "(or FUSESTATE_META_URL)")
    raise UserError(f"the volume keeps its metadata in {info.meta}, not {named}")


def load_or_create(remote: RemoteStore, block_size: Optional[int], create: bool,
                   meta_url: Optional[str] = None) -> VolumeInfo:
    """Read the volume descriptor; create the volume if the prefix is empty. A mount that
    names another metadata engine than the volume's is refused."""
    try:
        raw = remote.get(DESCRIPTOR)
    except FileNotFoundError:
        raw = None
    except RemoteError as exc:
        raise UserError(f"cannot read the volume descriptor: {exc}") from None
    if raw is not None:
        try:
            doc = json.loads(raw)
            info = VolumeInfo(doc["volume_id"], int(doc["block_size"]), int(doc["format"]),
                              doc.get("meta", "sqlite"))
        except (ValueError, KeyError) as exc:
            raise UserError(f"{remote.path(DESCRIPTOR)} is not a fusestate volume descriptor ({exc})") from None
        if info.format > FORMAT_VERSION:
            raise UserError(f"volume format {info.format} is newer than this fusestate understands")
        if block_size is not None and block_size != info.block_size:
            raise UserError(
                f"the volume uses {info.block_size}-byte blocks; --block-size {block_size} does not match"
            )
        _check_engine(info, meta_url)
        return info
    if not create:
        raise UserError(f"no fusestate volume at {remote.root} (mount it read-write once to create it)")
    info = VolumeInfo(uuid.uuid4().hex, block_size or DEFAULT_BLOCK_SIZE, FORMAT_VERSION, engine_identity(meta_url))
    doc = {"format": info.format, "volume_id": info.volume_id, "block_size": info.block_size, "meta": info.meta,
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    remote.put(DESCRIPTOR, json.dumps(doc, indent=2).encode())
    log.info("created volume %s at %s", info.volume_id, remote.root)
    return info
