"""A volume in the bucket and its descriptor.

Layout under the volume's root::

    fusestate.json              format version, block size, volume id
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
from dataclasses import dataclass
from typing import Optional

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


def load_or_create(remote: RemoteStore, block_size: Optional[int], create: bool) -> VolumeInfo:
    """Read the volume descriptor; create the volume if the prefix is empty."""
    try:
        raw = remote.get(DESCRIPTOR)
    except FileNotFoundError:
        raw = None
    except RemoteError as exc:
        raise UserError(f"cannot read the volume descriptor: {exc}") from None
    if raw is not None:
        try:
            doc = json.loads(raw)
            info = VolumeInfo(doc["volume_id"], int(doc["block_size"]), int(doc["format"]))
        except (ValueError, KeyError) as exc:
            raise UserError(f"{remote.path(DESCRIPTOR)} is not a fusestate volume descriptor ({exc})") from None
        if info.format > FORMAT_VERSION:
            raise UserError(f"volume format {info.format} is newer than this fusestate understands")
        if block_size is not None and block_size != info.block_size:
            raise UserError(
                f"the volume uses {info.block_size}-byte blocks; --block-size {block_size} does not match"
            )
        return info
    if not create:
        raise UserError(f"no fusestate volume at {remote.root} (mount it read-write once to create it)")
    info = VolumeInfo(uuid.uuid4().hex, block_size or 4 << 20, FORMAT_VERSION)
    doc = {"format": info.format, "volume_id": info.volume_id, "block_size": info.block_size,
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    remote.put(DESCRIPTOR, json.dumps(doc, indent=2).encode())
    log.info("created volume %s at %s", info.volume_id, remote.root)
    return info
