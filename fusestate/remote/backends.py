"""Turn a bucket URL into an fsspec filesystem and a root path, and check it is usable."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import urlparse

import fsspec
import fsspec.asyn
import fsspec.exceptions

from fusestate.errors import UserError

SUPPORTED_SCHEMES = ("file", "s3", "gs", "memory")


@dataclass(frozen=True)
class BucketLocation:
    scheme: str
    bucket: str       # bucket name, or the directory for file://
    root: str         # path inside the filesystem where the volume lives
    url: str


def parse_url(url: str) -> BucketLocation:
    parsed = urlparse(url)
    scheme = parsed.scheme
    if scheme == "gcs":
        scheme = "gs"
    if scheme not in SUPPORTED_SCHEMES:
        raise UserError(
            f"unsupported bucket URL {url!r}: expected one of "
            + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
        )
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise UserError(f"bad file URL {url!r}: use file:///absolute/path")
        path = os.path.abspath(parsed.path or "/")
        return BucketLocation(scheme, path, path.rstrip("/") or "/", url)
    if scheme == "memory":
        path = "/" + (parsed.netloc + parsed.path).strip("/")
        return BucketLocation(scheme, path, path, url)
    if not parsed.netloc:
        raise UserError(f"bad bucket URL {url!r}: no bucket name (expected {scheme}://bucket/prefix)")
    prefix = parsed.path.strip("/")
    root = parsed.netloc + ("/" + prefix if prefix else "")
    return BucketLocation(scheme, parsed.netloc, root, url)


def make_filesystem(location: BucketLocation, endpoint_url: Optional[str] = None,
                    timeout: float = 30.0) -> fsspec.AbstractFileSystem:
    """Build the fsspec filesystem; credentials follow each cloud's own conventions."""
    kwargs: dict[str, Any] = {}
    if location.scheme == "file":
        return fsspec.filesystem("file", auto_mkdir=True)
    if location.scheme == "memory":
        return fsspec.filesystem("memory")
    if location.scheme == "s3":
        endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint_url:
            kwargs["endpoint_url"] = endpoint_url
        kwargs["config_kwargs"] = {
            "connect_timeout": min(timeout, 10.0),
            "read_timeout": timeout,
            "retries": {"max_attempts": 2, "mode": "standard"},
        }
        kwargs["skip_instance_cache"] = True
        return fsspec.filesystem("s3", **kwargs)
    # gs
    endpoint_url = endpoint_url or os.environ.get("STORAGE_EMULATOR_HOST")
    if endpoint_url:
        kwargs["endpoint_url"] = endpoint_url
        if not os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
            # An explicit endpoint without credentials is an emulator.
            kwargs["token"] = "anon"
    kwargs["timeout"] = timeout
    kwargs["skip_instance_cache"] = True
    return fsspec.filesystem("gs", **kwargs)


def check_bucket(fs: fsspec.AbstractFileSystem, location: BucketLocation, deadline: float = 30.0) -> None:
    """Fail with one clear line if the bucket is missing, forbidden or unreachable.

    The clients retry on their own (gcsfs backs off for half a minute per request),
    so the whole check is bounded by ``deadline`` seconds.
    """
    if location.scheme == "file":
        if not os.path.isdir(location.bucket):
            raise UserError(f"bucket directory {location.bucket} does not exist (create it first)")
        if not os.access(location.bucket, os.W_OK | os.X_OK):
            raise UserError(f"bucket directory {location.bucket} is not writable")
        return
    if location.scheme == "memory":
        return
    try:
        if getattr(fs, "async_impl", False):
            fsspec.asyn.sync(fs.loop, fs._ls, location.bucket, detail=False, timeout=deadline)
        else:
            fs.ls(location.bucket, detail=False)
    except fsspec.exceptions.FSTimeoutError:
        raise UserError(f"cannot reach bucket {location.bucket!r}: no answer within {deadline:g} s") from None
    except FileNotFoundError:
        raise UserError(f"bucket {location.bucket!r} does not exist at {location.url}") from None
    except PermissionError as exc:
        raise UserError(f"access to bucket {location.bucket!r} denied: {first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - every client error becomes one line
        raise UserError(f"cannot reach bucket {location.bucket!r}: {first_line(exc)}") from None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def open_bucket(url: str, endpoint_url: Optional[str] = None, timeout: float = 30.0,
                check: bool = True) -> tuple[fsspec.AbstractFileSystem, BucketLocation]:
    location = parse_url(url)
    fs = make_filesystem(location, endpoint_url, timeout)
    if check:
        check_bucket(fs, location, timeout)
    return fs, location
