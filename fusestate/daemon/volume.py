"""A volume in the bucket and its descriptor.

Layout under the volume's root::

    fusestate.json              format version, block size, volume id, metadata engine
    blocks/ab/<hash>            content-addressed blocks (BLAKE3; SHA-256 before), never overwritten
    lease/<epoch>.json          one per read-write mount: holder, heartbeat, fencing
    meta/journal/...            metadata journal segments (see fusestate.meta.journal)
    meta/snapshot-...db         compacted metadata snapshots
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from urllib.parse import urlsplit
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
    """The database a volume's metadata lives in, as recorded: no user, no password."""
    if not meta_url:
        return "sqlite"
    parts = urlsplit(meta_url)
    host = parts.hostname or "localhost"
    return f"postgresql://{host}:{parts.port or 5432}{parts.path or '/'}"


def _check_engine(info: VolumeInfo, meta_url: Optional[str]) -> None:
    named = engine_identity(meta_url)
    if named == info.meta:
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
