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

import hashlib
import json
import logging
import os
import posixpath
import random
import time
import uuid
from typing import Any, Callable, Mapping, TypeVar

from .errors import SparkTrainError

log = logging.getLogger("sparktrain")

CHUNK = 8 * 1024 * 1024
#: Reads ask for larger ranges: fewer round trips, still bounded memory.
READ_CHUNK = 32 * 1024 * 1024
MANIFEST_SUFFIX = ".sparktrain.json"
DIR_MARKER = "_SPARKTRAIN_COMMITTED"
RETRIES = 5

_INSTALL_HINTS = {
    "abfs": "sparktrain[azure]", "abfss": "sparktrain[azure]", "az": "sparktrain[azure]",
    "adl": "sparktrain[azure]", "s3": "sparktrain[s3]", "s3a": "sparktrain[s3]",
}

T = TypeVar("T")


class StorageError(SparkTrainError):
    """A storage operation failed; the message names the URL and what to do, never credentials."""


class BackendMissingError(StorageError, ImportError):
    """The URL's scheme needs a package that is not installed."""


class UnknownSchemeError(StorageError, ValueError):
    """No fsspec backend knows the URL's scheme."""


class NotFoundError(StorageError, FileNotFoundError):
    """The container, bucket or checkpoint does not exist (or was never committed)."""


class CredentialsError(StorageError, PermissionError):
    """No credentials, or credentials the service rejects."""


class ForbiddenError(StorageError, PermissionError):
    """The credentials are valid but may not do this."""


class CorruptCheckpointError(StorageError):
    """The bytes read do not match the size or checksum recorded when they were written."""


def file_chunks(path: str, size: int):
    """The bytes of a local file, ``size`` at a time."""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(size)
            if not chunk:
                return
            yield chunk


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def _scrub(text: str, storage_options: Mapping[str, Any] | None) -> str:
    """Remove every credential-like value of ``storage_options`` from ``text``."""
    for value in (storage_options or {}).values():
        if isinstance(value, str) and len(value) >= 6:
            text = text.replace(value, "***")
    return text


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None):
    """``(fs, path)`` for ``url``; a clear error for an unknown scheme or a missing backend.

    The backend's own retries and timeouts are bounded (see ``AZURE_CLIENT`` and ``S3_CONFIG``),
    because ``_retry`` retries with backoff on top of them.
    """
    import fsspec

    scheme = _scheme(url)
    try:
        fs, path = fsspec.core.url_to_fs(url, **_bounded_options(scheme, storage_options))
        if type(fs).__module__.startswith("adlfs"):
            fs = _bounded_azure(fs, storage_options)
        return fs, path
    except ImportError:
        hint = _INSTALL_HINTS.get(scheme)
        raise BackendMissingError(
            f"{scheme}:// URLs need a storage backend that is not installed: "
            f"pip install {hint or 'the fsspec backend for ' + scheme}") from None
    except ValueError as e:
        if "Protocol not known" in str(e) or "not known" in str(e).lower():
            raise UnknownSchemeError(
                f"unknown URL scheme {scheme!r} in {url!r}: use abfs://, abfss://, az://, s3://, file:// or "
                "another fsspec scheme") from None
        raise StorageError(f"cannot open {url!r}: {_scrub(str(e), storage_options)}") from None


def check_url(url: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Validate a checkpoint URL on the driver before anything launches."""
    if not isinstance(url, str) or not url:
        raise StorageError(f"a checkpoint URL must be a non-empty string, got {url!r}")
    filesystem(url, storage_options)


# -- the backends' own retries ----------------------------------------------------------------------
# Left at their defaults, the SDKs retry a refused connection for minutes before sparktrain sees an
# error (measured with Azurite killed: about 3 minutes for one 100-byte put). sparktrain retries the
# whole operation with backoff, so each request gets only a few quick retries of its own: enough to
# resend one block after a blip without restarting a large upload. Keys the user sets win.

#: Keyword arguments for the Azure SDK's BlobServiceClient (its documented retry and timeout options).
#: The SDK waits initial_backoff + increment_base ** n before its n-th retry: here about 1 s each time.
AZURE_CLIENT = {"retry_total": 3, "retry_connect": 1, "initial_backoff": 0, "increment_base": 1,
                "random_jitter_range": 0.5, "connection_timeout": 10, "read_timeout": 60}
_AZURE_CLIENT_KEYS = (*AZURE_CLIENT, "retry_read", "retry_status", "retry_to_secondary", "retry_policy")
#: botocore ``Config`` settings for s3fs's ``config_kwargs``. Its timeouts are s3fs's defaults, made explicit.
S3_CONFIG = {"connect_timeout": 5, "read_timeout": 15, "retries": {"total_max_attempts": 2, "mode": "standard"}}

_AZURE_FS: dict[str, Any] = {}


def _bounded_options(scheme: str, storage_options: Mapping[str, Any] | None) -> dict:
    """``storage_options`` plus sparktrain's bounds for s3fs, where the user has not set them."""
    options = dict(storage_options or {})
    if scheme in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        for key, value in S3_CONFIG.items():
            # AWS_MAX_ATTEMPTS / AWS_RETRY_MODE are the user's retry settings too; a Config would override them.
            if key == "retries" and (os.environ.get("AWS_MAX_ATTEMPTS") or os.environ.get("AWS_RETRY_MODE")):
                continue
            config.setdefault(key, dict(value) if isinstance(value, dict) else value)  # ours stays unshared
        options["config_kwargs"] = config
    return options


def _bounded_azure(fs, storage_options: Mapping[str, Any] | None):
    """An adlfs filesystem whose Azure SDK client has sparktrain's bounded retries.

    adlfs hands none of its options to the BlobServiceClient it creates (fsspec/adlfs#502), so the
    client is rebuilt from its own endpoint and credential with the SDK's documented keyword options.
    This is done on a private instance, cached like fsspec's own, so that code using fsspec directly
    with the same options keeps the SDK's defaults.
    """
    mine = _AZURE_FS.get(fs._fs_token)
    if mine is not None:
        return mine
    from azure.storage.blob.aio import BlobServiceClient

    mine = type(fs)(**fs.storage_options, skip_instance_cache=True)
    old = mine.service_client
    settings = {**AZURE_CLIENT, **{k: v for k, v in (storage_options or {}).items() if k in _AZURE_CLIENT_KEYS}}
    client = BlobServiceClient(old.primary_endpoint, credential=old.credential, api_version=old.api_version,
                               secondary_hostname=old.secondary_hostname or None, **settings)
    client.location_mode = old.location_mode
    mine.service_client = client  # the old one never opened a connection: nothing to close
    _AZURE_FS[fs._fs_token] = mine
    return mine


# -- errors: permanent or transient ------------------------------------------------------------------

_TRANSIENT_NAMES = ("ServiceRequestError", "ServiceResponseError", "EndpointConnectionError", "ConnectTimeoutError",
                    "ReadTimeoutError", "ClientConnectorError", "ServerDisconnectedError", "ClientOSError",
                    "ConnectionClosedError", "IncompleteReadError", "ResponseStreamingError")


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the errors it was raised from: adlfs wraps the SDK's error in a RuntimeError."""
    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 8:
        chain.append(chain[-1].__cause__)
    return chain


def _classify(exc: BaseException, url: str, storage_options) -> StorageError | None:
    """Our error for a permanent failure, or None for a transient one worth retrying."""
    if isinstance(exc, StorageError):
        return exc
    chain = _causes(exc)
    names = {c.__name__ for e in chain for c in type(e).__mro__}
    text = " <- ".join(f"{type(e).__name__}: {e}" for e in chain)
    clean = _scrub(text, storage_options)
    statuses = [getattr(e, "status_code", None) or getattr(getattr(e, "response", None), "status_code", None)
                for e in chain]
    status = next((s for s in statuses if s is not None), None)
    if names & {"ClientAuthenticationError", "NoCredentialsError", "PartialCredentialsError"} or status == 401 or any(
            k in text for k in ("AuthenticationFailed", "failed to authenticate", "InvalidAccessKeyId",
                                "SignatureDoesNotMatch", "NoCredentialsError", "Unable to locate credentials")):
        return CredentialsError(
            f"{url}: the storage service rejected the credentials (or none were found). Pass them in "
            f"storage_options or the backend's usual environment variables. ({clean[:300]})")
    if status == 403 or any(k in text for k in ("AuthorizationPermissionMismatch", "AuthorizationFailure",
                                                "AccessDenied", "Forbidden")):
        return ForbiddenError(
            f"{url}: forbidden; the credentials are valid but may not do this (for ADLS, the identity needs "
            f"'Storage Blob Data Contributor'). ({clean[:300]})")
    if any(k in text.lower() for k in ("containernotfound", "nosuchbucket", "container does not exist",
                                      "bucket does not exist")):
        return NotFoundError(f"{url}: no such container or bucket; create it first, or fix the URL. ({clean[:300]})")
    if isinstance(exc, FileNotFoundError) or "BlobNotFound" in text or "NoSuchKey" in text or status == 404:
        return NotFoundError(f"{url}: not found. ({clean[:300]})")
    if names & set(_TRANSIENT_NAMES) or any(isinstance(e, (ConnectionError, TimeoutError)) for e in chain):
        return None  # a refused or dropped connection, however wrapped
    if isinstance(exc, OSError) and exc.errno is None and status is None:
        return None  # backends wrap network failures in bare OSErrors
    if status is not None and status >= 500:
        return None
    return StorageError(f"{url}: {clean[:500]}")


def _retry(what: str, url: str, storage_options, fn: Callable[[], T], attempts: int = RETRIES) -> T:
    """Run ``fn``, retrying transient failures with exponential backoff and jitter."""
    delay = 0.5
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified below
            err = _classify(e, url, storage_options)
            if err is not None:
                raise err from None
            if attempt == attempts:
                raise StorageError(
                    f"{what} {url} failed {attempts} times with transient errors; the last was "
                    f"{_scrub(f'{type(e).__name__}: {e}', storage_options)[:300]}") from None
            log.warning("sparktrain: %s %s failed (%s); retry %d of %d in %.1f s", what, url, type(e).__name__,
                        attempt, attempts - 1, delay)
            time.sleep(delay * (0.5 + random.random()))  # backoff between attempts, not synchronization
            delay = min(delay * 2, 8.0)
    raise AssertionError("unreachable")


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


def _put(url: str, chunks: Callable[[], Any], storage_options, metadata=None) -> str:
    fs, path = filesystem(url, storage_options)
    _mkdirs(fs, path)

    def attempt():
        size, sha = _stream_up(fs, path, chunks)
        fs.pipe_file(path + MANIFEST_SUFFIX, _manifest(size, sha, metadata))
        return url

    return _retry("writing", url, storage_options, attempt)


def _mkdirs(fs, path: str) -> None:
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(fs, LocalFileSystem):  # object stores have no directories to create
        fs.makedirs(posixpath.dirname(path), exist_ok=True)


def put_bytes(url: str, data: bytes, storage_options: Mapping[str, Any] | None = None,
              metadata: Mapping[str, Any] | None = None) -> str:
    """Write ``data`` to ``url`` atomically, with its size and checksum. Returns ``url``.

    ``metadata`` (JSON-able) is kept in the manifest; see :func:`read_manifest`.
    """
    view = memoryview(data)
    return _put(url, lambda: (view[i:i + CHUNK] for i in range(0, len(view), CHUNK)), storage_options, metadata)


def put_file(local_path: str, url: str, storage_options: Mapping[str, Any] | None = None,
             metadata: Mapping[str, Any] | None = None) -> str:
    """Stream a local file to ``url`` atomically, in chunks (memory does not grow with its size)."""
    return _put(url, lambda: file_chunks(local_path, CHUNK), storage_options, metadata)


def _read_manifest(fs, path: str, url: str) -> dict:
    try:
        return json.loads(fs.cat_file(path + MANIFEST_SUFFIX))
    except FileNotFoundError:
        if fs.exists(path):
            raise NotFoundError(f"{url} exists but was never committed (no manifest): a writer died or is "
                                "still writing") from None
        raise NotFoundError(f"{url}: no such checkpoint") from None


def read_manifest(url: str, storage_options: Mapping[str, Any] | None = None) -> dict:
    """The manifest of a committed object: ``size``, ``sha256``, ``written`` (time) and ``metadata``."""
    fs, path = filesystem(url, storage_options)
    return _retry("reading", url, storage_options, lambda: _read_manifest(fs, path, url))


def _stream_down(url: str, storage_options, start: Callable[[], Callable[[bytes], None]]) -> dict:
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

    return _retry("reading", url, storage_options, attempt)


def get_bytes(url: str, storage_options: Mapping[str, Any] | None = None) -> bytes:
    """Read a committed object, verified against its manifest."""
    parts: list[bytes] = []

    def start():
        parts.clear()
        return parts.append

    _stream_down(url, storage_options, start)
    return b"".join(parts)


def get_file(url: str, local_path: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """Stream a committed object to ``local_path`` (written beside it, then renamed), verified."""
    tmp = f"{local_path}.partial-{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "wb") as f:
            def start():
                f.seek(0)
                f.truncate()
                return f.write

            _stream_down(url, storage_options, start)
        os.replace(tmp, local_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return local_path


# -- directories -------------------------------------------------------------------------------------

def put_dir(local_dir: str, url: str, storage_options: Mapping[str, Any] | None = None) -> str:
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
    _retry("committing", url, storage_options, lambda: fs.pipe_file(path, json.dumps({"files": files}).encode()))
    return url


def get_dir(url: str, local_dir: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """Download a committed directory checkpoint; every file is verified."""
    marker = f"{url.rstrip('/')}/{DIR_MARKER}"
    fs, path = filesystem(marker, storage_options)
    try:
        files = json.loads(_retry("reading", marker, storage_options, lambda: fs.cat_file(path)))["files"]
    except NotFoundError:
        raise NotFoundError(f"{url} is not a committed directory checkpoint (no {DIR_MARKER})") from None
    for rel in files:
        target = os.path.join(local_dir, *rel.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        get_file(f"{url.rstrip('/')}/{rel}", target, storage_options)
    return local_dir


# -- listing -----------------------------------------------------------------------------------------

def list_checkpoints(prefix: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Committed checkpoints directly under ``prefix`` (objects and directories), oldest first."""
    fs, path = filesystem(prefix, storage_options)
    scheme = _scheme(prefix)

    def listing():
        fs.invalidate_cache(path)  # backends cache listings; another process may have committed since
        try:
            return fs.ls(path, detail=False)
        except FileNotFoundError:
            return []

    entries = _retry("listing", prefix, storage_options, listing)
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


def latest_checkpoint(prefix: str, storage_options: Mapping[str, Any] | None = None) -> str | None:
    """The most recently committed checkpoint under ``prefix``, or None."""
    found = list_checkpoints(prefix, storage_options)
    return found[-1] if found else None
