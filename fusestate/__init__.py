"""fusestate: a bucket mounted as a POSIX directory for RocksDB and Spark state."""

__version__ = "0.1.0"
