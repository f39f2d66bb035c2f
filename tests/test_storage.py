"""sparktrain.storage against real backends: file://, memory://, s3:// on moto's server, abfs:// and az:// on Azurite."""
from __future__ import annotations

import os
import uuid

import pytest

from sparktrain import storage
from storage_servers import fresh_place

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["file", "memory", "s3", "abfs", "az"])
def target(request, tmp_path):
    """(base URL, storage_options, fs) of a fresh, empty place on each backend."""
    return fresh_place(request, request.param, tmp_path, "ckpt")


def test_bytes_round_trip_with_manifest(target):
    base, options = target
    url = f"{base}/model.bin"
    data = os.urandom(3 * storage.CHUNK + 17)  # several chunks
    assert storage.put_bytes(url, data, options) == url
    assert storage.get_bytes(url, options) == data
    fs, path = storage.filesystem(url, options)
    assert fs.exists(path + storage.MANIFEST_SUFFIX)
    assert not [p for p in fs.ls(os.path.dirname(path), detail=False) if ".partial-" in p]  # no leftovers


def test_file_and_directory_round_trip(target, tmp_path):
    base, options = target
    src = tmp_path / "src"
    (src / "variables").mkdir(parents=True)
    (src / "saved_model.pb").write_bytes(os.urandom(1000))
    (src / "variables" / "data-0").write_bytes(os.urandom(5 * 1024 * 1024))
    storage.put_file(str(src / "saved_model.pb"), f"{base}/one.pb", options)
    storage.get_file(f"{base}/one.pb", str(tmp_path / "one.pb"), options)
    assert (tmp_path / "one.pb").read_bytes() == (src / "saved_model.pb").read_bytes()
    storage.put_dir(str(src), f"{base}/dir", options)
    out = tmp_path / "out"
    storage.get_dir(f"{base}/dir", str(out), options)
    assert (out / "variables" / "data-0").read_bytes() == (src / "variables" / "data-0").read_bytes()
    assert (out / "saved_model.pb").read_bytes() == (src / "saved_model.pb").read_bytes()


def test_list_and_latest_see_only_committed_checkpoints(target):
    base, options = target
    assert storage.latest_checkpoint(base, options) is None
    for epoch in (1, 2, 3):
        storage.put_bytes(f"{base}/epoch-{epoch}.keras", b"weights %d" % epoch, options)
    # A writer that died after the data but before the manifest: not a checkpoint.
    fs, path = storage.filesystem(f"{base}/epoch-4.keras", options)
    fs.pipe_file(path, b"half")
    found = storage.list_checkpoints(base, options)
    assert [u.rsplit("/", 1)[-1] for u in found] == ["epoch-1.keras", "epoch-2.keras", "epoch-3.keras"]
    latest = storage.latest_checkpoint(base, options)
    assert latest.endswith("epoch-3.keras") and storage.get_bytes(latest, options) == b"weights 3"
    with pytest.raises(storage.NotFoundError, match="never committed"):
        storage.get_bytes(f"{base}/epoch-4.keras", options)


def test_corruption_behind_our_back_is_detected(target):
    base, options = target
    url = f"{base}/model.bin"
    storage.put_bytes(url, b"A" * 1000, options)
    fs, path = storage.filesystem(url, options)
    fs.pipe_file(path, b"A" * 999 + b"B")  # same size, one byte changed
    with pytest.raises(storage.CorruptCheckpointError, match="is corrupt"):
        storage.get_bytes(url, options)


def test_missing_checkpoint(target):
    base, options = target
    with pytest.raises(storage.NotFoundError):
        storage.get_bytes(f"{base}/nothing-here", options)


def test_unknown_scheme_and_missing_backend_have_their_own_errors():
    with pytest.raises(storage.UnknownSchemeError, match="unknown URL scheme 'nosuch'"):
        storage.check_url("nosuch://bucket/x")
    with pytest.raises(storage.BackendMissingError, match="pip install"):
        storage.check_url("gcs://bucket/x")


def test_azure_wrong_credentials_and_missing_container(azurite):
    wrong_key = "A" * 86 + "=="
    options = azurite.options(key=wrong_key)
    with pytest.raises(storage.CredentialsError) as e:
        storage.put_bytes("abfs://anything/x.bin", b"x", options)
    assert wrong_key not in str(e.value)  # credentials never appear in messages
    with pytest.raises(storage.NotFoundError, match="no such container"):
        storage.put_bytes(f"abfs://no-such-container-{uuid.uuid4().hex[:8]}/x.bin", b"x", azurite.options())


def test_s3_missing_bucket(moto_s3):
    with pytest.raises(storage.NotFoundError, match="no such container or bucket"):
        storage.put_bytes(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x.bin", b"x", moto_s3)


LARGE_SCRIPT = r"""
import os, resource, sys
from sparktrain import storage
url, options, src, dst = sys.argv[1], eval(sys.argv[2]), sys.argv[3], sys.argv[4]
storage.filesystem(url, options)  # import the backend before the baseline
def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
base = peak_mib()
storage.put_file(src, url, options)
after_put = peak_mib()
storage.get_file(url, dst, options)
print(base, after_put, peak_mib())
"""


@pytest.mark.timeout(300)
def test_one_gib_round_trip_in_bounded_memory(azurite, tmp_path):
    """1 GiB through put_file and get_file on Azurite; the process's peak RSS grows by less than 256 MiB."""
    import subprocess
    import sys

    options = azurite.options()
    fs, _ = storage.filesystem("abfs://x", options)
    container = f"large-{uuid.uuid4().hex[:8]}"
    fs.mkdir(container)
    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    block = os.urandom(1 << 20)
    with open(src, "wb") as f:
        for _ in range(1024):
            f.write(block)
    proc = subprocess.run([sys.executable, "-c", LARGE_SCRIPT, f"abfs://{container}/big.bin", repr(options),
                           str(src), str(dst)], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    base, after_put, after_get = map(float, proc.stdout.split())
    assert after_get - base < 256, (base, after_put, after_get)
    assert os.path.getsize(dst) == 1 << 30
    with open(src, "rb") as a, open(dst, "rb") as b:
        while True:
            x, y = a.read(1 << 24), b.read(1 << 24)
            assert x == y
            if not x:
                break


def test_a_source_that_fails_mid_stream_leaves_nothing_at_the_url(target):
    """The chunk source fails after one block (a disk error, say): the put fails at once, nothing is at
    the URL, no partial object is left, and the same put then succeeds."""
    import errno

    base, options = target
    storage.put_bytes(f"{base}/epoch-1.keras", b"before", options)
    url = f"{base}/epoch-2.keras"
    data = os.urandom(2 * storage.CHUNK + 5)
    calls = []

    def chunks():
        calls.append(1)
        yield data[:storage.CHUNK]
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(storage.StorageError, match="Input/output error"):
        storage.put_chunks(url, chunks, options)
    assert len(calls) == 1  # not the storage's fault: raised at once, not retried
    fs, path = storage.filesystem(url, options)
    fs.invalidate_cache()
    assert not fs.exists(path) and not fs.exists(path + storage.MANIFEST_SUFFIX)
    assert not [p for p in fs.ls(os.path.dirname(path), detail=False) if ".partial-" in p]
    with pytest.raises(storage.NotFoundError, match="no such checkpoint"):
        storage.get_bytes(url, options)
    assert storage.latest_checkpoint(base, options).endswith("epoch-1.keras")
    storage.put_bytes(url, data, options)
    assert storage.get_bytes(url, options) == data
