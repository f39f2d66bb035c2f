"""sparktrain.storage when the storage server, or the writer, dies mid-upload.

The server: Azurite is SIGKILLed and restarted on the same port and workspace. moto is cut off by
a proxy that drops every connection and refuses new ones (``ThreadedMotoServer.stop()`` only stops
accepting, so open connections would go on being served; and a moto in another process would lose
its state when killed). The kill happens from inside the chunk source, after the first block was
uploaded and before the next: no thread, no sleep, no race.

The writer: a process that is streaming a put is SIGKILLed once it says it is mid-stream.
"""
from __future__ import annotations

import os
import socket
import threading
import time
import uuid

import pytest

from sparktrain import storage
from storage_servers import AZURITE_ACCOUNT, AZURITE_KEY

pytestmark = pytest.mark.timeout(240)

#: How long a put may take to give up once the server is dead (measured: 13 to 25 s).
FAIL_WITHIN_S = 60


def chunks_then(kill, data: bytes):
    """A chunk source for ``storage.put_chunks`` (what put_bytes and put_file use) that calls ``kill()``
    when first asked for its second chunk.

    The first chunk fills a whole block, so the backend has uploaded it by then: the put is
    mid-stream. The retries that follow stream without killing anything.
    """
    calls = []

    def chunks():
        calls.append(1)
        for i in range(0, len(data), storage.CHUNK):
            if i == storage.CHUNK and len(calls) == 1:
                kill()
            yield data[i:i + storage.CHUNK]

    return chunks, calls


def kill_mid_upload_then_restart(base: str, options: dict, kill, restart, durable=lambda: None) -> None:
    """The scenario, the same on every backend.

    A checkpoint is committed (``durable()`` makes sure the server keeps it through a kill). A second
    put dies mid-stream with the server: it fails within FAIL_WITHIN_S, after retrying, as transient.
    After the restart the first checkpoint is still there and nothing is at the second URL. The same
    put then commits, and reads back the same bytes.
    """
    before_url, url = f"{base}/epoch-1.keras", f"{base}/epoch-2.keras"
    before = os.urandom(1000)
    storage.put_bytes(before_url, before, options)
    durable()
    data = os.urandom(3 * storage.CHUNK + 17)
    chunks, calls = chunks_then(kill, data)

    started = time.monotonic()
    with pytest.raises(storage.StorageError, match="transient errors") as failed:
        storage.put_chunks(url, chunks, options)
    took = time.monotonic() - started
    assert took < FAIL_WITHIN_S, f"giving up took {took:.1f} s"
    assert len(calls) == storage.RETRIES  # every attempt was made: not taken for a permanent error
    assert AZURITE_KEY not in str(failed.value)

    restart()
    fs, path = storage.filesystem(url, options)
    fs.invalidate_cache()
    assert not fs.exists(path) and not fs.exists(path + storage.MANIFEST_SUFFIX)
    with pytest.raises(storage.NotFoundError, match="no such checkpoint"):
        storage.get_bytes(url, options)
    assert storage.list_checkpoints(base, options) == [before_url]
    assert storage.get_bytes(before_url, options) == before  # the server kept its data through the kill

    assert storage.put_bytes(url, data, options) == url
    assert storage.get_bytes(url, options) == data
    assert storage.latest_checkpoint(base, options) == url
    print(f"\n{base.split(':')[0]}:// put with the server dead gave up after {took:.1f} s")


def test_azurite_killed_mid_upload_then_restarted(own_azurite):
    options = own_azurite.options()
    fs, _ = storage.filesystem("abfs://x", options)
    container = f"faults-{uuid.uuid4().hex[:8]}"
    fs.mkdir(container)

    def durable():
        # Azurite saves its metadata every 5 s and on a clean exit. A clean restart makes the container
        # and the first checkpoint durable, as a real service's are, before the hard kill.
        own_azurite.stop()
        own_azurite.start()

    kill_mid_upload_then_restart(f"abfs://{container}/run", options, kill=own_azurite.kill,
                                 restart=own_azurite.start, durable=durable)


def test_s3_cut_off_mid_upload_then_back(cuttable_s3):
    options, proxy = cuttable_s3
    fs, _ = storage.filesystem("s3://x", options)
    bucket = f"faults-{uuid.uuid4().hex[:8]}"
    fs.mkdir(bucket)
    kill_mid_upload_then_restart(f"s3://{bucket}/run", options, kill=proxy.kill, restart=proxy.start)


# -- the Azure SDK's own retries ---------------------------------------------------------------------

class Unavailable:
    """An HTTP server that answers every request with 503 Service Unavailable, counting them."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            with conn:
                head = b""
                while b"\r\n\r\n" not in head and (part := conn.recv(4096)):
                    head += part
                self.requests += 1
                conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    def close(self):
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()


@pytest.mark.parametrize("user_settings, requests", [
    ({}, 1 + storage.AZURE_CLIENT["retry_total"]),
    ({"retry_total": 0}, 1),
    ({"retry_status": 1}, 2),
])
def test_azure_sdk_retries_are_sparktrains_unless_the_user_sets_them(user_settings, requests):
    """A request is tried as often as sparktrain's settings say, or the user's where given."""
    server = Unavailable()
    try:
        options = {"account_name": AZURITE_ACCOUNT, **user_settings, "connection_string": (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint=http://127.0.0.1:{server.port}/{AZURITE_ACCOUNT};")}
        fs, path = storage.filesystem("abfs://container/x.bin", options)
        with pytest.raises(Exception) as e:
            fs.cat_file(path)  # the filesystem alone: no retries of sparktrain's own
        assert storage.classify_error(e.value, "abfs://container/x.bin", options) is None  # transient
        assert server.requests == requests
    finally:
        server.close()


def test_s3_retries_are_sparktrains_unless_the_user_sets_them(moto_s3, monkeypatch):
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    fs, _ = storage.filesystem("s3://bucket/x", moto_s3)
    assert fs.config_kwargs == storage.S3_CONFIG
    mine = {"retries": {"max_attempts": 7}, "read_timeout": 300}
    fs, _ = storage.filesystem("s3://bucket/x", {**moto_s3, "config_kwargs": mine})
    assert fs.config_kwargs == {**storage.S3_CONFIG, **mine}
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "9")  # botocore's own setting, which a Config would override
    fs, _ = storage.filesystem("s3://bucket/x", moto_s3)
    assert "retries" not in fs.config_kwargs


# -- the writer is killed --------------------------------------------------------------------------

WRITER = r"""
import sys
from sparktrain import storage
url, options = sys.argv[1], eval(sys.argv[2])

def chunks():
    yield bytes(storage.CHUNK)  # a whole block: the backend writes it before asking for more
    print("streaming", flush=True)
    sys.stdin.readline()  # the test kills this process here
    yield b"never"

storage.put_chunks(url, chunks, options)
"""


@pytest.mark.parametrize("backend", ["file", "s3", "abfs"])
def test_writer_killed_mid_upload_leaves_nothing_at_the_url(backend, request, tmp_path):
    """A process SIGKILLed in the middle of a put: nothing at the URL; its partial is no checkpoint."""
    import select
    import signal
    import subprocess
    import sys

    if backend == "file":
        base, options = f"file://{tmp_path}/run", None
    elif backend == "s3":
        options = request.getfixturevalue("moto_s3")
        bucket = f"killed-{uuid.uuid4().hex[:8]}"
        storage.filesystem("s3://x", options)[0].mkdir(bucket)
        base = f"s3://{bucket}/run"
    else:
        options = request.getfixturevalue("azurite").options()
        container = f"killed-{uuid.uuid4().hex[:8]}"
        storage.filesystem("abfs://x", options)[0].mkdir(container)
        base = f"abfs://{container}/run"
    before_url, url = f"{base}/epoch-1.keras", f"{base}/epoch-2.keras"
    storage.put_bytes(before_url, b"before", options)

    proc = subprocess.Popen([sys.executable, "-c", WRITER, url, repr(options)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready and proc.stdout.readline() == b"streaming\n", proc.stderr.read().decode()[-2000:]
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait(10)

    fs, path = storage.filesystem(url, options)
    fs.invalidate_cache()
    assert not fs.exists(path) and not fs.exists(path + storage.MANIFEST_SUFFIX)
    if backend == "file":  # the block written before the kill is there, under its temporary name
        assert [p for p in fs.ls(os.path.dirname(path), detail=False) if ".partial-" in p]
    with pytest.raises(storage.NotFoundError, match="no such checkpoint"):
        storage.get_bytes(url, options)
    assert storage.list_checkpoints(base, options) == [before_url]
    data = os.urandom(storage.CHUNK + 1)
    storage.put_bytes(url, data, options)
    assert storage.get_bytes(url, options) == data
