"""Where state is warm: which of the volume's files this node holds in its own cache.

On a shared volume every node sees every file, but a file's blocks are local (in memory,
in the disk cache, or staged for upload) only where they were written or read. A scheduler
that puts a state store's partition back on a node where its files are warm avoids reading
them from the bucket; an operator who lost a node can see where its state has gone warm
since. Blocks are content-addressed, so a file is warm on a node when the keys of its block
map are local there, whoever wrote them.

The answer is computed by walking the namespace (one block-map query per file), so it is
asked for on demand (``fusestate status --warm``) and refreshed for the metrics every
:data:`REFRESH_SECONDS`, bounded to :data:`MAX_FILES` files per walk.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Callable

from fusestate.meta.engine import ROOT_INODE, FsError, Inode, MetaEngine

REFRESH_SECONDS = 60.0
MAX_FILES = 20_000


@dataclass
class WarmDir:
    """One directory's regular files (not its subdirectories'), and how much of them is local."""

    path: str
    files: int = 0
    warm_files: int = 0    # files with at least one block local
    bytes: int = 0
    warm_bytes: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Locality:
    dirs: list[WarmDir]
    files_seen: int
    truncated: bool        # the walk stopped at its file limit

    def as_dict(self) -> dict:
        return {"dirs": [d.as_dict() for d in self.dirs], "files_seen": self.files_seen, "truncated": self.truncated}


async def _resolve(meta: MetaEngine, path: str) -> int:
    ino = ROOT_INODE
    for part in [p for p in path.split("/") if p]:
        ino = (await meta.lookup(ino, os.fsencode(part))).id
    return ino


async def warm_dirs(meta: MetaEngine, is_local: Callable[[str], bool], block_size: int, path: str = "",
                    max_files: int = MAX_FILES) -> Locality:
    """Every directory under ``path`` (relative to the mount) that holds regular files, with
    the bytes of them whose blocks ``is_local``; directories in walk order (parents first)."""
    try:
        start = await _resolve(meta, path)
    except FsError:
        return Locality([], 0, False)
    return await _walk(meta, is_local, block_size, start, "/" + path.strip("/"), max_files)


async def warm_share(meta: MetaEngine, is_local: Callable[[str], bool], block_size: int, ino: int,
                     max_files: int = MAX_FILES) -> tuple[int, int]:
    """The bytes of the regular files under directory ``ino`` (or of file ``ino``) whose blocks
    ``is_local``, and their bytes in all: whether a state store is this node's to load."""
    node = await meta.getattr(ino)
    if node.is_reg:
        return await _file_warm_bytes(meta, is_local, block_size, node), node.size
    walk = await _walk(meta, is_local, block_size, ino, "/", max_files)
    return sum(d.warm_bytes for d in walk.dirs), sum(d.bytes for d in walk.dirs)


async def _file_warm_bytes(meta: MetaEngine, is_local: Callable[[str], bool], block_size: int, node: Inode) -> int:
    warm = 0
    for index, key in (await meta.block_map(node.id)).items():
        if is_local(key):
            warm += max(0, min(block_size, node.size - index * block_size))
    return warm


async def _walk(meta: MetaEngine, is_local: Callable[[str], bool], block_size: int, start: int, start_path: str,
                max_files: int) -> Locality:
    queue: list[tuple[int, str]] = [(start, start_path)]
    result: list[WarmDir] = []
    seen = 0
    while queue:
        ino, dir_path = queue.pop(0)
        here = WarmDir(dir_path)
        after = 0
        while True:
            try:
                page = await meta.readdir(ino, after)
            except FsError:  # removed while we walked
                break
            if not page:
                break
            for entry, node in page:
                after = entry.entry_id
                child = os.path.join(dir_path, os.fsdecode(entry.name))
                if node.is_dir:
                    queue.append((node.id, child))
                elif node.is_reg:
                    if seen >= max_files:
                        return Locality(result + ([here] if here.files else []), seen, True)
                    seen += 1
                    here.files += 1
                    here.bytes += node.size
                    warm = await _file_warm_bytes(meta, is_local, block_size, node)
                    if warm:
                        here.warm_files += 1
                        here.warm_bytes += warm
        if here.files:
            result.append(here)
    return Locality(result, seen, False)
