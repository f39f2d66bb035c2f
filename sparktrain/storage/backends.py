"""How sparktrain reaches one storage URL: the fsspec filesystem, bounded backend retries, and
which errors are worth retrying.

``filesystem`` is the one place a URL becomes an fsspec filesystem. The Azure and S3 SDKs retry
for minutes by default; here each request gets a few quick retries of its own, and
:func:`retry` retries whole operations with backoff on top, after :func:`classify_error` has
sorted permanent failures (credentials, permissions, not found) from transient ones.
"""
from __future__ import annotations

import logging
import os
import random
import time
from typing import Any, Callable, Mapping, TypeVar, Union


from ..errors import (BackendMissingError, CredentialsError, ForbiddenError, NotFoundError, StorageError,
                      UnknownSchemeError)

log = logging.getLogger("sparktrain")

#: Credentials and options for a URL's backend, as fsspec takes them; never logged.
StorageOptions = Union[Mapping[str, Any], None]

#: Attempts of one storage operation before it fails.
RETRIES = 5

T = TypeVar("T")

_INSTALL_HINTS = {
    "abfs": "sparktrain[azure]", "abfss": "sparktrain[azure]", "az": "sparktrain[azure]",
    "adl": "sparktrain[azure]", "s3": "sparktrain[s3]", "s3a": "sparktrain[s3]",
}


def scheme_of(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def _scrub(text: str, storage_options: StorageOptions) -> str:
    """Remove every credential-like value of ``storage_options`` from ``text``."""
    for value in (storage_options or {}).values():
        if isinstance(value, str) and len(value) >= 6:
            text = text.replace(value, "***")
    return text


def filesystem(url: str, storage_options: StorageOptions = None):
    """``(fs, path)`` for ``url``; a clear error for an unknown scheme or a missing backend.

    The backend's own retries and timeouts are bounded (see ``AZURE_CLIENT`` and ``S3_CONFIG``),
    because ``retry`` retries with backoff on top of them.
    """
    import fsspec

    scheme = scheme_of(url)
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


def forget_listings(fs, path: str) -> None:
    """Drop the listings ``fs`` holds of ``path`` and of every folder above it. s3fs and adlfs keep
    the folders this process listed and answer a file's size (``info``, which ``open`` and s3fs's
    ``cat_file`` ask) from them, so a file another process wrote since would be "not found"."""
    path = fs._strip_protocol(path).rstrip("/")
    while path:
        fs.invalidate_cache(path)  # s3fs drops the parents too; adlfs only this one
        parent = fs._parent(path).rstrip("/")
        if parent == path:
            return
        path = parent


def check_url(url: str, storage_options: StorageOptions = None) -> None:
    """Validate a checkpoint URL on the driver before anything launches."""
    if not isinstance(url, str) or not url:
        raise StorageError(f"a checkpoint URL must be a non-empty string, got {url!r}")
    filesystem(url, storage_options)


# -- the backends' own retries ----------------------------------------------------------------------
# Left at their defaults, the SDKs retry a refused connection for minutes before sparktrain sees an
# error. sparktrain retries the
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


def _bounded_options(scheme: str, storage_options: StorageOptions) -> dict:
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


def _bounded_azure(fs, storage_options: StorageOptions):
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


def classify_error(exc: BaseException, url: str, storage_options: StorageOptions) -> StorageError | None:
    """Our error for a permanent failure, or None for a transient one worth retrying.

    >>> classify_error(ConnectionRefusedError(111, "refused"), "s3://b/k", None) is None
    True
    """
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


def retry(what: str, url: str, storage_options: StorageOptions, fn: Callable[[], T], attempts: int = RETRIES) -> T:
    """Run ``fn``, retrying transient failures with exponential backoff and jitter."""
    delay = 0.5
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified below
            err = classify_error(e, url, storage_options)
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
