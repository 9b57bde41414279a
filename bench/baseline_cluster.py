"""The Spark cluster of the benchmarks' baselines: no fusestate volume, every node's local dir
on its local disk, and the checkpoint under a root the benchmark chooses: ``s3a://bucket/prefix``
(what most jobs run: the pipeline's arguments then name the S3A connector), or a directory on
another file system every node mounts (JuiceFS, ``bench/juicefs_cluster.py``)."""

from __future__ import annotations

import os
from typing import Any

from fusestate.spark.cluster import Cluster


class BaselineCluster(Cluster):
    def __init__(self, root: str | os.PathLike, *, checkpoint_root: str, **kw: Any) -> None:
        super().__init__(root, None, None, **kw)
        self.checkpoint_root = checkpoint_root.rstrip("/")

    def checkpoint(self, query: str) -> str:
        return f"{self.checkpoint_root}/{query}"
