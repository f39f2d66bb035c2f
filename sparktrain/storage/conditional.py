"""Conditional writes of one small object: create it only where none is, replace it only if it is
still the version read. A run's lease is built on them (``sparktrain.storage.lease``).

Each store uses its own mechanism where it has one:

- local files: a new object is written beside its place and hard-linked into it (``os.link``
  fails where a file already is); a replacement is written beside it and renamed over it while
  an exclusive ``flock`` on ``<name>.lock`` is held, after the version (inode and modification
  time) has been checked again;
- S3 (s3fs): ``PutObject`` with ``If-None-Match: *`` to create (s3fs's ``mode="create"``) and
  ``If-Match: <ETag>`` to replace, the ETag read with the object in one ``GetObject``;
- ADLS and Azure Blob (adlfs): the Blob service's ``upload_blob(overwrite=False)`` (``If-None-Match: *``)
  to create, and ``etag=`` with ``MatchConditions.IfNotModified`` (``If-Match``) to replace, the
  ETag read with the blob in one download.

Any other fsspec store (``memory://``, ...) gets a check and a write, which is not atomic
between processes: :func:`atomic` says whether a URL's store has the real thing.
"""
from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any, Iterator, Tuple

from .backends import StorageOptions, filesystem, retry

#: What :func:`read` returns: the object's bytes and its version, for :func:`replace`.
Versioned = Tuple[bytes, Any]


def _kind(fs) -> str:
    module = type(fs).__module__
    if module.startswith("s3fs"):
        return "s3"
    if module.startswith("adlfs"):
        return "azure"
    if module.startswith("fsspec.implementations.local"):
        return "file"
    return "other"


def atomic(url: str, storage_options: StorageOptions = None) -> bool:
    """Whether ``url``'s store does conditional writes atomically (local files, S3, Azure)."""
    fs, _ = filesystem(url, storage_options)
    return _kind(fs) != "other"


def mechanism(url: str, storage_options: StorageOptions = None) -> str:
    """How ``url``'s store writes conditionally, in words (for logs and the docs' claims)."""
    return {"file": "hard link (create) and flock + rename (replace)",
            "s3": "PutObject If-None-Match: * (create) and If-Match: ETag (replace)",
            "azure": "upload_blob overwrite=False (create) and ETag IfNotModified (replace)",
            "other": "check then write (not atomic between processes)"}[_kind(filesystem(url, storage_options)[0])]


def read(url: str, storage_options: StorageOptions = None) -> Versioned | None:
    """``(bytes, version)`` of the object at ``url``, or None where there is none."""
    fs, path = filesystem(url, storage_options)
    kind = _kind(fs)

    def attempt():
        try:
            if kind == "s3":
                bucket, key, _ = fs.split_path(path)
                out = fs.call_s3("get_object", Bucket=bucket, Key=key)
                return _s3_body(fs, out), out["ETag"]
            if kind == "azure":
                return _azure_read(fs, path)
            if kind == "file":
                with _local_lock(path):
                    return _local_read(path)
            return fs.cat_file(path), None
        except FileNotFoundError:
            return None

    return retry("reading", url, storage_options, attempt)


def create(url: str, data: bytes, storage_options: StorageOptions = None) -> bool:
    """Write ``data`` at ``url`` only where no object is; returns whether it did."""
    fs, path = filesystem(url, storage_options)
    kind = _kind(fs)

    def attempt():
        try:
            if kind == "s3":
                fs.pipe_file(path, data, mode="create")
            elif kind == "azure":
                fs.pipe_file(path, data, mode="create")
            elif kind == "file":
                _local_create(path, data)
            else:
                if fs.exists(path):
                    return False
                fs.pipe_file(path, data)
            return True
        except FileExistsError:
            return False
        except Exception as e:  # noqa: BLE001 - a failed precondition is an answer, anything else is retried
            if _precondition_failed(e):
                return False
            raise

    return retry("creating", url, storage_options, attempt)


def replace(url: str, data: bytes, version: Any, storage_options: StorageOptions = None) -> bool:
    """Write ``data`` at ``url`` only if the object there is still ``version`` (from :func:`read`);
    returns whether it did."""
    fs, path = filesystem(url, storage_options)
    kind = _kind(fs)

    def attempt():
        try:
            if kind == "s3":
                fs.pipe_file(path, data, IfMatch=version)
            elif kind == "azure":
                _azure_replace(fs, path, data, version)
            elif kind == "file":
                return _local_replace(path, data, version)
            else:
                fs.pipe_file(path, data)
            return True
        except FileNotFoundError:
            return False
        except Exception as e:  # noqa: BLE001 - as in create
            if _precondition_failed(e):
                return False
            raise

    return retry("replacing", url, storage_options, attempt)


def _precondition_failed(e: BaseException) -> bool:
    chain = [e]
    while chain[-1].__cause__ is not None and len(chain) < 8:
        chain.append(chain[-1].__cause__)
    text = " ".join(f"{type(c).__name__} {c}" for c in chain)
    return any(k in text for k in ("PreconditionFailed", "Precondition Failed", "ConditionNotMet", "412",
                                   "ResourceModifiedError", "BlobAlreadyExists", "ResourceExistsError"))


# -- S3 ---------------------------------------------------------------------------------------------

def _s3_body(fs, response) -> bytes:
    from fsspec.asyn import sync

    async def body():
        async with response["Body"] as stream:
            return await stream.read()

    return sync(fs.loop, body)


# -- Azure ------------------------------------------------------------------------------------------

def _azure_read(fs, path: str) -> Versioned:
    from azure.core.exceptions import ResourceNotFoundError
    from fsspec.asyn import sync

    container, blob, _ = fs.split_path(path)

    async def download():
        async with fs.service_client.get_blob_client(container=container, blob=blob) as client:
            try:
                stream = await client.download_blob()
            except ResourceNotFoundError:
                raise FileNotFoundError(path) from None
            return await stream.readall(), stream.properties.etag

    return sync(fs.loop, download)


def _azure_replace(fs, path: str, data: bytes, etag: str) -> None:
    from azure.core import MatchConditions
    from fsspec.asyn import sync

    container, blob, _ = fs.split_path(path)

    async def upload():
        async with fs.service_client.get_blob_client(container=container, blob=blob) as client:
            await client.upload_blob(data, overwrite=True, etag=etag, match_condition=MatchConditions.IfNotModified)

    sync(fs.loop, upload)
    fs.invalidate_cache(fs._parent(path))


# -- local files ------------------------------------------------------------------------------------

@contextlib.contextmanager
def _local_lock(path: str) -> Iterator[None]:
    import fcntl

    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _local_read(path: str) -> Versioned:
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        return f.read(), (st.st_ino, st.st_mtime_ns, st.st_size)


def _beside(path: str, data: bytes) -> str:
    tmp = f"{path}.partial-{uuid.uuid4().hex[:12]}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def _local_create(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = _beside(path, data)
    try:
        os.link(tmp, path)  # whole, or FileExistsError
    finally:
        os.unlink(tmp)


def _local_replace(path: str, data: bytes, version: Any) -> bool:
    with _local_lock(path):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        if (st.st_ino, st.st_mtime_ns, st.st_size) != tuple(version):
            return False
        os.replace(_beside(path, data), path)
        return True

