"""Hadoop's S3A connector for a checkpoint on an object store (``s3a://bucket/prefix``), with
the state on local disk: the setup most Spark users run today, which ``fusestate spark-pipeline
--local --checkpoint s3a://...`` runs and prints the settings of (``--print-conf``), as the
starting point of a move to fusestate (docs/spark.md, "From a checkpoint on S3").

The connector is ``org.apache.hadoop:hadoop-aws`` at the version of the Hadoop client Spark
ships (PySpark's ``jars/hadoop-client-api-<version>.jar``), with the AWS SDK bundle it depends
on. Spark fetches both itself with ``spark.jars.packages`` (:func:`package`); a job that has
them already passes their paths instead (``jars``), so no session waits for a resolution.
Fetching them ahead of time is the benchmarks' business (``bench/s3a.py``).

:func:`s3a_conf` writes the settings an S3-compatible endpoint that is not AWS needs (Hadoop's
"Working with third-party S3 stores"): the endpoint URL, its region (SigV4 signs with one),
path-style requests, plain HTTP when the URL says so. Everything else keeps S3A's defaults, so
the setup is what a user gets: among them, since hadoop-aws 3.4.2, no request checksums
beyond the MD5 header (``fs.s3a.checksum.generation=false``), which third-party stores accept.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence
from urllib.parse import urlsplit

SCHEME = "s3a"
HADOOP_AWS = "org.apache.hadoop:hadoop-aws"
HADOOP_PREFIX = "spark.hadoop.fs.s3a."


def hadoop_version() -> str:
    """The Hadoop client version PySpark ships: hadoop-aws must match it."""
    import pyspark

    jars = Path(pyspark.__file__).resolve().parent / "jars"
    found = sorted(jars.glob("hadoop-client-api-*.jar"))
    if not found:
        raise FileNotFoundError(f"no hadoop-client-api-*.jar in {jars}: cannot tell which hadoop-aws matches")
    return found[-1].name.removeprefix("hadoop-client-api-").removesuffix(".jar")


def package(version: Optional[str] = None) -> str:
    """The Maven coordinates of the connector, for ``spark.jars.packages``."""
    return f"{HADOOP_AWS}:{version or hadoop_version()}"


def is_s3a(location: Optional[str | os.PathLike]) -> bool:
    return location is not None and urlsplit(os.fspath(location)).scheme.lower() == SCHEME


def s3a_conf(endpoint: Optional[str] = None, *, region: Optional[str] = None,
             access_key: Optional[str] = None, secret_key: Optional[str] = None,
             jars: Sequence[str | os.PathLike] = ()) -> dict[str, str]:
    """Spark settings for an ``s3a://`` checkpoint.

    ``endpoint``: an S3-compatible endpoint's URL (None: AWS, region from the environment).
    ``access_key``/``secret_key``: static credentials (None: S3A's default chain, e.g.
    ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``). ``jars``: the connector's jars on this
    machine (hadoop-aws, the AWS SDK bundle, and their runtime dependencies); none: Spark
    resolves :func:`package` from Maven Central when the session starts.
    """
    conf: dict[str, str] = {}
    if endpoint:
        url = urlsplit(endpoint)
        conf.update({
            HADOOP_PREFIX + "endpoint": endpoint,
            # SigV4 signs with a region; any name does for a store that is not AWS.
            HADOOP_PREFIX + "endpoint.region": region or "us-east-1",
            # A store addressed by IP or without wildcard DNS has no bucket.host names.
            HADOOP_PREFIX + "path.style.access": "true",
            HADOOP_PREFIX + "connection.ssl.enabled": "true" if url.scheme == "https" else "false",
        })
    elif region:
        conf[HADOOP_PREFIX + "endpoint.region"] = region
    if access_key is not None and secret_key is not None:
        conf.update({HADOOP_PREFIX + "access.key": access_key, HADOOP_PREFIX + "secret.key": secret_key,
                     HADOOP_PREFIX + "aws.credentials.provider":
                         "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider"})
    paths = [str(Path(j).resolve()) for j in jars]
    if paths:
        # spark.jars adds them to the driver's and executors' class loaders; Hadoop looks file
        # system classes up on the JVM's class path as well, so they go there too.
        conf.update({"spark.jars": ",".join(paths), "spark.driver.extraClassPath": os.pathsep.join(paths),
                     "spark.executor.extraClassPath": os.pathsep.join(paths)})
    else:
        conf["spark.jars.packages"] = package()
    return conf


def missing_connector(conf: dict[str, str]) -> Optional[str]:
    """Why an ``s3a://`` checkpoint cannot load with these settings, or None: hadoop-aws must be on
    ``spark.jars.packages`` or, as an existing file, on ``spark.jars``."""
    if HADOOP_AWS in conf.get("spark.jars.packages", ""):
        return None
    jars = [j.strip().removeprefix("file://") for j in conf.get("spark.jars", "").split(",") if j.strip()]
    aws = [j for j in jars if Path(j).name.startswith("hadoop-aws-")]
    if not aws:
        return (f"an {SCHEME}:// checkpoint needs Hadoop's S3A connector: spark.jars.packages={package()} "
                f"(fetched by Spark when the session starts), or its jars on spark.jars")
    absent = [j for j in jars if not Path(j).is_file()]
    if absent:
        return f"the S3A connector's jar {absent[0]} does not exist"
    return None
