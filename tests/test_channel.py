"""The driver channel admits only peers holding the run's secret, and checks before parsing."""
import queue
import socket

import pytest

from sparktrain import channel
from sparktrain.driver.server import DriverServer, Hello, Output, Refused


def _event(server, kind, timeout=10.0):
    while True:
        ev = server.events.get(timeout=timeout)
        if isinstance(ev, kind):
            return ev


@pytest.fixture
def server():
    s = DriverServer(channel.new_secret(), size=2, host="127.0.0.1")
    yield s
    s.close()


def _hello(rank, port=1000):
    return {"type": "hello", "rank": rank, "host": "127.0.0.1", "port": port, "master_port": 9, "pid": 1}


def test_rendezvous_and_output(server):
    a = channel.connect(server.address, server.secret, timeout=5)
    b = channel.connect(server.address, server.secret, timeout=5)
    a.send(_hello(1, 1001))
    b.send(_hello(0, 1000))
    peers = a.recv()
    # No rank was fed a DataFrame, so each rank's row counts ("shards") are empty.
    assert peers == {"type": "peers", "hosts": ["127.0.0.1"] * 2, "ports": [1000, 1001], "master_port": 9,
                     "shards": [{}, {}]}
    assert b.recv() == peers
    a.send({"type": "out", "stream": "stdout", "line": "hi", "time": 1.0})
    assert _event(server, Output) == Output(1, "stdout", "hi", 1.0)
    server.abort("test stop")
    assert a.recv() == {"type": "abort", "reason": "test stop"}
    a.close()
    b.close()


def test_wrong_secret_is_refused_and_run_goes_on(server):
    bad = channel.connect(server.address, b"x" * 32, timeout=5)
    bad.send(_hello(0))
    assert _event(server, Refused).reason == "message authentication failed"
    assert bad.sock.recv(1) == b""  # dropped
    good = channel.connect(server.address, server.secret, timeout=5)
    good.send(_hello(0))
    assert _event(server, Hello).rank == 0
    assert server.missing_ranks() == [1]
    good.close()


def test_raw_socket_garbage_and_huge_frames_are_refused(server):
    for payload in (b"\x00\x00\x00\x05" + b"A" * 37, b"\xff\xff\xff\xff" + b"B" * 64):
        with socket.create_connection(server.address, timeout=5) as raw:
            raw.recv(64)  # greeting
            raw.sendall(payload)
            assert raw.recv(1) == b""
        assert isinstance(_event(server, Refused), Refused)
    assert server.missing_ranks() == [0, 1]


def test_replayed_frame_is_refused(server):
    """A frame recorded on one connection does not authenticate on another (fresh nonce)."""
    recorded = []
    chan = channel.connect(server.address, server.secret, timeout=5)
    chan.sock = _Recorder(chan.sock, recorded)
    chan.send(_hello(0))
    assert _event(server, Hello).rank == 0
    with socket.create_connection(server.address, timeout=5) as raw:
        raw.recv(64)
        raw.sendall(recorded[0])
        assert raw.recv(1) == b""
    assert _event(server, Refused).reason == "message authentication failed"
    chan.close()


class _Recorder:
    def __init__(self, sock, sink):
        self._sock, self._sink = sock, sink

    def sendall(self, data):
        self._sink.append(data)
        return self._sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_close_is_prompt_and_idempotent_with_idle_connections(server):
    idle = socket.create_connection(server.address, timeout=5)
    server.close()
    with pytest.raises(queue.Empty):
        while True:
            ev = server.events.get_nowait()
            assert isinstance(ev, Refused)
    idle.close()
