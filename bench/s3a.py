"""Hadoop's S3A connector for the Spark scenarios' ``s3a`` baseline, fetched once from Maven Central.

``hadoop-aws`` at the version of PySpark's ``hadoop-client-api``, and its runtime dependencies
(the AWS SDK v2 ``bundle``, about 700 MB, and two small jars), resolved by Maven into a local
repository under ``~/.cache/fusestate-bench/m2`` (``FUSESTATE_BENCH_CACHE`` moves it): never in
the source tree, and fetched again only when the Hadoop version changes. A session then puts the
jars on its class path (``fusestate spark-pipeline --s3a-jars``) instead of resolving them with
``spark.jars.packages`` at every JVM start, which a timed restart would count.

    python -m bench.s3a          # fetch, then print the jars
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from fusestate.spark.s3a import HADOOP_AWS, hadoop_version

CACHE = Path(os.environ.get("FUSESTATE_BENCH_CACHE", Path.home() / ".cache" / "fusestate-bench"))
FETCH_TIMEOUT = 1800.0
# What Maven or the JVM says when the machine cannot reach the repository at all (as opposed to an
# artifact it refused): the only case in which a test may skip rather than fail.
OFFLINE = re.compile(r"UnknownHostException|Network is unreachable|No route to host|Connection timed out|"
                     r"connect timed out|Temporary failure in name resolution")

POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>fusestate.bench</groupId><artifactId>s3a-connector</artifactId><version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>{group}</groupId><artifactId>{artifact}</artifactId><version>{version}</version></dependency>
  </dependencies>
</project>
"""


class ConnectorUnavailable(RuntimeError):
    """The connector could not be fetched; ``offline`` when the repository was not reachable at all."""

    def __init__(self, message: str, offline: bool = False) -> None:
        super().__init__(message)
        self.offline = offline


def connector_jars(version: Optional[str] = None, cache: Path = CACHE) -> list[Path]:
    """The connector's jars (hadoop-aws first), fetched into ``cache`` unless they are there.
    One process fetches at a time (two test workers, say): Maven does not lock its repository."""
    version = version or hadoop_version()
    home = cache / f"s3a-{version}"
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _fetched(version, home, cache)


def _fetched(version: str, home: Path, cache: Path) -> list[Path]:
    listing = home / "classpath.txt"
    if listing.exists():
        jars = [Path(p) for p in listing.read_text().strip().split(os.pathsep) if p]
        if jars and all(j.is_file() for j in jars):
            return _ordered(jars)
    mvn = shutil.which("mvn")
    if mvn is None:
        raise ConnectorUnavailable("Maven (mvn) is not installed: the s3a baseline fetches Hadoop's S3A connector "
                                   "with it (bash scripts/setup.sh installs it)")
    group, artifact = HADOOP_AWS.split(":")
    (home / "pom.xml").write_text(POM.format(group=group, artifact=artifact, version=version))
    partial = home / "classpath.tmp"
    cmd = [mvn, "-B", "-q", "-f", str(home / "pom.xml"), f"-Dmaven.repo.local={cache / 'm2'}",
           "dependency:build-classpath", "-Dmdep.includeScope=runtime", f"-Dmdep.outputFile={partial}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=FETCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise ConnectorUnavailable(f"fetching {HADOOP_AWS}:{version} took over {FETCH_TIMEOUT:.0f} s",
                                   offline=True) from None
    said = proc.stdout + proc.stderr
    if proc.returncode != 0 or not partial.exists():
        errors = [ln.strip() for ln in said.splitlines() if "[ERROR]" in ln] or said.strip().splitlines()[-3:]
        raise ConnectorUnavailable(f"could not fetch {HADOOP_AWS}:{version} and its dependencies with Maven: "
                                   + " | ".join(errors[:3])[:600], offline=bool(OFFLINE.search(said)))
    os.replace(partial, listing)
    return _ordered([Path(p) for p in listing.read_text().strip().split(os.pathsep) if p])


def _ordered(jars: list[Path]) -> list[Path]:
    return sorted(jars, key=lambda j: (not j.name.startswith("hadoop-aws-"), j.name))


def jars_argument(jars: list[Path]) -> str:
    """The jars as ``fusestate spark-pipeline --s3a-jars`` takes them."""
    return ",".join(str(j) for j in jars)


if __name__ == "__main__":
    try:
        print("\n".join(str(j) for j in connector_jars()))
    except ConnectorUnavailable as exc:
        sys.exit(f"bench.s3a: {exc}")
