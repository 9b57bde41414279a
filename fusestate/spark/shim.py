"""The ``fusestate://`` Hadoop file system (spark/shim) as an installed artifact.

Every Spark JVM that reads or writes a ``fusestate://`` checkpoint (the driver and each
executor) needs the shim's jar on its class path. It ships inside the package
(``fusestate/spark/jars``), so a wheel install or a read-only image has it at a path
:func:`installed_jar` names, with no JDK or build step at run time. ``spark/shim/build.sh``
rebuilds it from the sources; the digest of those sources is in the jar's manifest, so a
stale jar is detected (:func:`jar_digest` against :func:`source_digest`).
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

from fusestate.errors import UserError

JAR_NAME = "fusestate-hadoop-shim.jar"
DIGEST_ATTRIBUTE = "Fusestate-Source-Digest"
SCHEME = "fusestate"
FS_CLASS = "io.fusestate.hadoop.FusestateFileSystem"
AFS_CLASS = "io.fusestate.hadoop.FusestateFs"
# A Spark plugin (spark.plugins) that ends an executor at once when its local dirs' mount dies.
MOUNT_WATCH_CLASS = "io.fusestate.hadoop.MountWatch"
# A Spark plugin that fills a lost executor's state stores into the survivors' page cache.
LOSS_FILL_CLASS = "io.fusestate.hadoop.LossFill"
# A Spark plugin and a streaming query listener that start each state store of a (re)started
# query on the node whose cache holds it.
AFFINITY_CLASS = "io.fusestate.hadoop.StoreAffinity"
AFFINITY_LISTENER_CLASS = "io.fusestate.hadoop.StoreAffinity$Listener"
PLUGINS = f"{MOUNT_WATCH_CLASS},{LOSS_FILL_CLASS},{AFFINITY_CLASS}"


def installed_jar() -> Path:
    """The jar shipped with this installation of fusestate."""
    return Path(__file__).resolve().parent / "jars" / JAR_NAME


def source_digest(shim_dir: str | os.PathLike) -> str:
    """A digest of the shim's Java sources (paths relative to ``shim_dir`` and contents)."""
    root = Path(shim_dir)
    h = hashlib.sha256()
    for path in sorted(root.glob("src/**/*.java")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def jar_digest(jar: str | os.PathLike) -> str:
    """The source digest a jar was built from (its manifest's ``Fusestate-Source-Digest``)."""
    try:
        with zipfile.ZipFile(jar) as z:
            manifest = z.read("META-INF/MANIFEST.MF").decode()
    except (OSError, KeyError, zipfile.BadZipFile) as exc:
        raise UserError(f"{jar} is not a fusestate shim jar: {exc}") from None
    # A manifest folds lines at 72 bytes: a continuation starts with one space.
    for line in manifest.replace("\r\n", "\n").replace("\n ", "").splitlines():
        name, _, value = line.partition(":")
        if name.strip() == DIGEST_ATTRIBUTE:
            return value.strip()
    raise UserError(f"{jar} has no {DIGEST_ATTRIBUTE} in its manifest: rebuild it with spark/shim/build.sh")
