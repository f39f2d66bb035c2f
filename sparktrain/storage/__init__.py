"""Checkpoints on remote storage through fsspec URLs: atomic, verified, streamed, retried.

Any fsspec URL works: ``abfs://``/``abfss://``/``az://`` (adlfs), ``s3://`` (s3fs), ``file://``,
``memory://``. Credentials come only from ``storage_options`` or the backend's own environment
and config; they are never logged and never put in an error message.

Layout of one checkpoint object at ``URL``:

- ``URL`` holds the bytes. They are streamed to ``URL.partial-<id>`` first and moved into place
  only when complete, so a reader never sees half an object at ``URL``.
- ``URL.sparktrain.json`` is the manifest (size and SHA-256), written last: an object without
  it is not committed, and every read is checked against it.

A directory checkpoint is committed by ``URL/_SPARKTRAIN_COMMITTED``, written after every
file, listing each file's size and checksum.
"""
from __future__ import annotations
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import time
import uuid
from typing import Any, Callable, Iterable, Mapping

from ..errors import (BackendMissingError, CorruptCheckpointError, CredentialsError, ForbiddenError,  # noqa: F401
                      NotFoundError, StorageError, UnknownSchemeError)
from ..host.localfiles import file_chunks, replaced_atomically
from .backends import (AZURE_CLIENT, RETRIES, S3_CONFIG, StorageOptions, check_url, classify_error,  # noqa: F401
                       filesystem, forget_listings, retry, scheme_of)

CHUNK = 8 * 1024 * 1024
#: Reads ask for larger ranges: fewer round trips, still bounded memory.
READ_CHUNK = 32 * 1024 * 1024
MANIFEST_SUFFIX = ".sparktrain.json"
DIR_MARKER = "_SPARKTRAIN_COMMITTED"


# -- objects ---------------------------------------------------------------------------------------

def _manifest(size: int, sha256: str, metadata: Mapping[str, Any] | None = None) -> bytes:
    return json.dumps({"format": "sparktrain-checkpoint/1", "size": size, "sha256": sha256,
                       "written": time.time(), "metadata": dict(metadata or {})}).encode()


def _stream_up(fs, path: str, chunks) -> tuple[int, str]:
    """Write ``chunks`` to ``path.partial-<id>``, then move it to ``path``; returns (size, sha256)."""
    tmp = f"{path}.partial-{uuid.uuid4().hex[:12]}"
    digest = hashlib.sha256()
    size = 0
    try:
        with fs.open(tmp, "wb", block_size=CHUNK) as f:  # the backend buffers one block at a time
            for chunk in chunks():
                digest.update(chunk)
                size += len(chunk)
                f.write(chunk)
        fs.mv(tmp, path)
    except BaseException:
        try:
            if fs.exists(tmp):
                fs.rm(tmp)
        except Exception:  # noqa: BLE001 - the original error matters more
            pass
        raise
    return size, digest.hexdigest()


def put_chunks(url: str, chunks: Callable[[], Iterable[bytes]], storage_options: StorageOptions = None,
               metadata: Mapping[str, Any] | None = None) -> str:
    """Stream the bytes ``chunks()`` yields to ``url`` atomically, with their size and checksum.

    ``chunks`` is called afresh for every attempt, so a transient failure restarts the upload
    from the first chunk. :func:`put_bytes` and :func:`put_file` are this with their own sources.

    >>> put_chunks("memory://ckpt/a.bin", lambda: iter([b"ab", b"cd"]))   # doctest: +SKIP
    'memory://ckpt/a.bin'
    """
    fs, path = filesystem(url, storage_options)
    _mkdirs(fs, path)

    def attempt():
        size, sha = _stream_up(fs, path, chunks)
        fs.pipe_file(path + MANIFEST_SUFFIX, _manifest(size, sha, metadata))
        return url

    return retry("writing", url, storage_options, attempt)


def _mkdirs(fs, path: str) -> None:
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(fs, LocalFileSystem):  # object stores have no directories to create
        fs.makedirs(posixpath.dirname(path), exist_ok=True)


def put_bytes(url: str, data: bytes, storage_options: StorageOptions = None,
              metadata: Mapping[str, Any] | None = None) -> str:
    """Write ``data`` to ``url`` atomically, with its size and checksum. Returns ``url``.

    ``metadata`` (JSON-able) is kept in the manifest; see :func:`read_manifest`.
    """
    view = memoryview(data)
    return put_chunks(url, lambda: (view[i:i + CHUNK] for i in range(0, len(view), CHUNK)), storage_options, metadata)


def put_file(local_path: str, url: str, storage_options: StorageOptions = None,
             metadata: Mapping[str, Any] | None = None) -> str:
    """Stream a local file to ``url`` atomically, in chunks (memory does not grow with its size)."""
    return put_chunks(url, lambda: file_chunks(local_path, CHUNK), storage_options, metadata)


def _read_manifest(fs, path: str, url: str) -> dict:
    forget_listings(fs, path)  # another process may have committed it since this one listed its folder
    try:
        return json.loads(fs.cat_file(path + MANIFEST_SUFFIX))
    except FileNotFoundError:
        if fs.exists(path):
            raise NotFoundError(f"{url} exists but was never committed (no manifest): a writer died or is "
                                "still writing") from None
        raise NotFoundError(f"{url}: no such checkpoint") from None


def read_manifest(url: str, storage_options: StorageOptions = None) -> dict:
    """The manifest of a committed object: ``size``, ``sha256``, ``written`` (time) and ``metadata``."""
    fs, path = filesystem(url, storage_options)
    return retry("reading", url, storage_options, lambda: _read_manifest(fs, path, url))


def _stream_down(url: str, storage_options: StorageOptions, start: Callable[[], Callable[[bytes], None]]) -> dict:
    """Read ``url`` in chunks into the sink ``start()`` returns (called afresh for each attempt)."""
    fs, path = filesystem(url, storage_options)

    def attempt():
        manifest = _read_manifest(fs, path, url)
        sink = start()
        digest = hashlib.sha256()
        size = 0
        with fs.open(path, "rb", block_size=READ_CHUNK, cache_type="none") as f:  # no read-ahead cache to grow
            while True:
                chunk = f.read(READ_CHUNK)
                if not chunk:
                    break
                digest.update(chunk)
                size += len(chunk)
                sink(chunk)
        if size != manifest["size"] or digest.hexdigest() != manifest["sha256"]:
            raise CorruptCheckpointError(
                f"{url} is corrupt: read {size} bytes with sha256 {digest.hexdigest()[:16]}..., but "
                f"{manifest['size']} bytes with sha256 {manifest['sha256'][:16]}... were written. Restore it "
                "or use an earlier checkpoint")
        return manifest

    return retry("reading", url, storage_options, attempt)


def get_bytes(url: str, storage_options: StorageOptions = None) -> bytes:
    """Read a committed object, verified against its manifest."""
    parts: list[bytes] = []

    def start():
        parts.clear()
        return parts.append

    _stream_down(url, storage_options, start)
    return b"".join(parts)


def get_file(url: str, local_path: str, storage_options: StorageOptions = None) -> str:
    """Stream a committed object to ``local_path`` (written beside it, then renamed), verified."""
    with replaced_atomically(local_path) as tmp, open(tmp, "wb") as f:
        def start():
            f.seek(0)
            f.truncate()
            return f.write

        _stream_down(url, storage_options, start)
    return local_path


# -- directories -------------------------------------------------------------------------------------

def put_dir(local_dir: str, url: str, storage_options: StorageOptions = None) -> str:
    """Upload every file under ``local_dir`` to ``url/``, then commit with a marker written last."""
    files = {}
    for root, _, names in os.walk(local_dir):
        for name in sorted(names):
            full = os.path.join(root, name)
            rel = os.path.relpath(full, local_dir).replace(os.sep, "/")
            put_file(full, f"{url.rstrip('/')}/{rel}", storage_options)
            fs, path = filesystem(f"{url.rstrip('/')}/{rel}", storage_options)
            files[rel] = json.loads(fs.cat_file(path + MANIFEST_SUFFIX))
    marker = f"{url.rstrip('/')}/{DIR_MARKER}"
    fs, path = filesystem(marker, storage_options)
    retry("committing", url, storage_options, lambda: fs.pipe_file(path, json.dumps({"files": files}).encode()))
    return url


def get_dir(url: str, local_dir: str, storage_options: StorageOptions = None) -> str:
    """Download a committed directory checkpoint; every file is verified."""
    marker = f"{url.rstrip('/')}/{DIR_MARKER}"
    fs, path = filesystem(marker, storage_options)
    try:
        files = json.loads(retry("reading", marker, storage_options, lambda: fs.cat_file(path)))["files"]
    except NotFoundError:
        raise NotFoundError(f"{url} is not a committed directory checkpoint (no {DIR_MARKER})") from None
    for rel in files:
        target = os.path.join(local_dir, *rel.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        get_file(f"{url.rstrip('/')}/{rel}", target, storage_options)
    return local_dir


# -- listing -----------------------------------------------------------------------------------------

def list_checkpoints(prefix: str, storage_options: StorageOptions = None) -> list[str]:
    """Committed checkpoints directly under ``prefix`` (objects and directories), oldest first."""
    fs, path = filesystem(prefix, storage_options)
    scheme = scheme_of(prefix)

    def listing():
        fs.invalidate_cache(path)  # backends cache listings; another process may have committed since
        try:
            return fs.ls(path, detail=False)
        except FileNotFoundError:
            return []

    entries = retry("listing", prefix, storage_options, listing)
    found = []
    for entry in entries:
        entry = entry.rstrip("/")
        name = posixpath.basename(entry)
        if name.endswith(MANIFEST_SUFFIX):
            manifest = json.loads(fs.cat_file(entry))
            found.append((manifest.get("written", 0.0), entry[: -len(MANIFEST_SUFFIX)]))
        elif fs.exists(f"{entry}/{DIR_MARKER}"):
            found.append((fs.info(f"{entry}/{DIR_MARKER}").get("mtime") or 0.0, entry))
    found.sort(key=lambda item: (item[0] if isinstance(item[0], (int, float)) else 0.0, item[1]))
    return [_unstrip(scheme, prefix, fs, p) for _, p in found]


def _unstrip(scheme: str, prefix: str, fs, path: str) -> str:
    if scheme == "file" and "://" not in prefix:
        return path
    return fs.unstrip_protocol(path) if scheme != "file" else f"file://{path}"


def latest_checkpoint(prefix: str, storage_options: StorageOptions = None) -> str | None:
    """The most recently committed checkpoint under ``prefix``, or None."""
    found = list_checkpoints(prefix, storage_options)
    return found[-1] if found else None


# -- mirroring a growing directory --------------------------------------------------------------------

def sync_dir(local_dir: str, url: str, storage_options: StorageOptions = None,
             synced: dict[str, tuple[int, int]] | None = None) -> dict[str, tuple[int, int]]:
    """Copy every file under ``local_dir`` that is new or changed since the last call to ``url/``.

    For logs that grow while a program runs, such as TensorBoard's event files: each call uploads
    the files whose size or modification time differ from ``synced`` (what the previous call
    returned) and returns the new state. Files are copied whole, with no manifest: each upload
    replaces the remote file, and a reader sees the old or the new copy on object stores.

    >>> state = sync_dir("/tmp/logs", "abfs://runs/tb")          # doctest: +SKIP
    >>> state = sync_dir("/tmp/logs", "abfs://runs/tb", synced=state)   # only what changed
    """
    synced = dict(synced or {})
    base = url.rstrip("/")
    for root, _, names in os.walk(local_dir):
        for name in sorted(names):
            full = os.path.join(root, name)
            try:
                st = os.stat(full)
            except FileNotFoundError:  # removed while we walked
                continue
            rel = os.path.relpath(full, local_dir).replace(os.sep, "/")
            stamp = (st.st_size, st.st_mtime_ns)
            if synced.get(rel) == stamp:
                continue
            target = f"{base}/{rel}"
            fs, path = filesystem(target, storage_options)
            _mkdirs(fs, path)
            retry("syncing", target, storage_options, lambda: fs.put_file(full, path))
            synced[rel] = stamp
    return synced
