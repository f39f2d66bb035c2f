"""Real storage servers for the tests: Azurite (the Azure Blob emulator, from npm) and moto's S3 server.

Each fixture starts its server on 127.0.0.1 with a free port and stops it at the end. The fault
tests get their own Azurite (``own_azurite``), which they kill and restart, and reach moto through
a ``CuttableProxy``, whose ``kill`` drops every connection and stops listening.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The Azure Storage emulator's published development account (not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def free_port(host: str = "127.0.0.1") -> int:
    """A free port for a server this suite starts, from where the ranks' ports come: below the
    kernel's ephemeral range, which an outgoing connection could take before the server binds."""
    from sparktrain.executor.rendezvous import reserve_port

    with reserve_port(host) as s:
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen | None = None, timeout: float = 30.0,
                   host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)  # no event for "a port started listening"; bounded poll
    raise TimeoutError(f"nothing listened on {host}:{port} within {timeout} s")


def azurite_binary() -> str | None:
    local = os.path.join(ROOT, ".node", "node_modules", ".bin", "azurite-blob")
    return local if os.path.exists(local) else shutil.which("azurite-blob")


class Azurite:
    """One azurite-blob process with its own workspace; restartable on the same port and data.
    ``host``: the address it listens on (the simulated hosts' bridge, for the multi-host tier)."""

    def __init__(self, host: str = "127.0.0.1"):
        self.binary = azurite_binary()
        self.host = host
        self.port = free_port(host)
        self.workspace = tempfile.mkdtemp(prefix="azurite-")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--blobHost", self.host, "--blobPort", str(self.port), "--location", self.workspace,
             "--silent", "--disableTelemetry", "--skipApiVersionCheck", "--loose"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_listening(self.port, self.proc, host=self.host)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def connection_string(self, key: str = AZURITE_KEY) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={key};"
                f"BlobEndpoint=http://{self.host}:{self.port}/{AZURITE_ACCOUNT};")

    def options(self, key: str = AZURITE_KEY) -> dict:
        return {"account_name": AZURITE_ACCOUNT, "connection_string": self.connection_string(key)}


class CuttableProxy:
    """A TCP proxy on its own port in front of ``target_port``.

    ``kill()`` does to clients what a dead server does: every open connection is dropped and new
    ones are refused. ``start()`` listens on the same port again. The server behind it keeps its
    state, which moto, living in this process, would lose if it were stopped instead.
    """

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", self.port))  # SO_REUSEADDR: the same port again
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # kill() shut the listener
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:  # killed meanwhile: this connection dies too
                    client.close()
                    upstream.close()
                    return
                self._sockets.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def kill(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._sockets = self._sockets, set()
        if listener is not None:
            listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone would not
            listener.close()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def require_azurite() -> None:
    if azurite_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("azurite-blob is not installed: run `npm install --prefix .node azurite` (see README)")
        pytest.skip("azurite-blob is not installed (npm install --prefix .node azurite)")


@pytest.fixture(scope="session")
def azurite():
    require_azurite()
    server = Azurite()
    server.start()
    yield server
    server.stop()
    shutil.rmtree(server.workspace, ignore_errors=True)


@pytest.fixture(scope="session")
def moto_s3():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    wait_listening(port)
    yield {"key": "testing", "secret": "testing",
           "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "eu-west-1"}}
    server.stop()


@pytest.fixture
def own_azurite():
    """An Azurite of this test's own, to kill and restart without disturbing the shared one."""
    require_azurite()
    server = Azurite()
    server.start()
    yield server
    server.kill()
    shutil.rmtree(server.workspace, ignore_errors=True)


@pytest.fixture
def cuttable_s3(moto_s3):
    """``(storage_options, proxy)``: the shared moto server, reached through a proxy this test may kill."""
    port = int(moto_s3["client_kwargs"]["endpoint_url"].rsplit(":", 1)[1])
    proxy = CuttableProxy(port)
    proxy.start()
    options = {**moto_s3, "client_kwargs": {**moto_s3["client_kwargs"],
                                            "endpoint_url": f"http://127.0.0.1:{proxy.port}"}}
    yield options, proxy
    proxy.kill()


def fresh_place(request, scheme: str, tmp_path, leaf: str) -> tuple[str, dict | None]:
    """(URL, storage_options) of a fresh, empty place on ``scheme``'s store, ending in ``leaf``: a
    tmp_path folder, memory://, a new bucket on moto's S3, or a new container on Azurite (abfs or az)."""
    import uuid

    from sparktrain import storage

    name = uuid.uuid4().hex[:10]
    if scheme == "file":
        return f"file://{tmp_path}/{leaf}", None
    if scheme == "memory":
        return f"memory://sparktrain-tests/{name}", None
    if scheme == "s3":
        options = request.getfixturevalue("moto_s3")
        fs, _ = storage.filesystem("s3://x", options)
        fs.mkdir(f"bucket-{name}")
        return f"s3://bucket-{name}/{leaf}", options
    options = request.getfixturevalue("azurite").options()
    fs, _ = storage.filesystem("abfs://x", options)
    fs.mkdir(f"container-{name}")
    return f"{scheme}://container-{name}/{leaf}", options
