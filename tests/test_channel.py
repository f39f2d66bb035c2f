"""The driver channel admits only peers holding the run's secret, and checks before parsing."""
import queue
import socket

import pytest

from sparktrain.seam import channel, protocol
from sparktrain.errors import RankFailure
from sparktrain.driver.supervise.server import DriverServer, Output, Refused
from sparktrain.driver.supervise.supervision import CheckedIn, RankFailed


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


def _hello(rank, port=1000, host="127.0.0.1"):
    return protocol.CheckedIn(rank=rank, host=host, port=port, master_port=9, pid=1)


def test_rendezvous_and_output(server):
    a = channel.connect(server.address, server.secret, timeout=5)
    b = channel.connect(server.address, server.secret, timeout=5)
    a.send(_hello(1, 1001))
    b.send(_hello(0, 1000))
    peers = a.recv()
    # No rank was fed a DataFrame, so each rank's row counts ("shards") are empty.
    assert peers == protocol.Peers(("127.0.0.1",) * 2, (1000, 1001), 9, ({}, {}))
    assert b.recv() == peers
    a.send(protocol.Output("stdout", "hi", 1.0))
    assert _event(server, Output) == Output(1, "stdout", "hi", 1.0)
    server.abort("test stop")
    assert a.recv() == protocol.Abort("test stop")
    a.close()
    b.close()


def test_wrong_secret_is_refused_and_run_goes_on(server):
    bad = channel.connect(server.address, b"x" * 32, timeout=5)
    bad.send(_hello(0))
    assert _event(server, Refused).reason == "message authentication failed"
    assert bad.sock.recv(1) == b""  # dropped
    good = channel.connect(server.address, server.secret, timeout=5)
    good.send(_hello(0))
    assert _event(server, CheckedIn).rank == 0
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


@pytest.mark.parametrize("encrypted", [False, True], ids=["clear", "encrypted"])
def test_replayed_frame_is_refused(encrypted):
    """A frame recorded on one connection does not authenticate on another (fresh nonces); an
    encrypted channel shows nothing of what it carries, and refuses a rank that expects otherwise."""
    server = DriverServer(channel.new_secret(), size=2, host="127.0.0.1", encrypted=encrypted)
    try:
        recorded = []
        chan = channel.connect(server.address, server.secret, timeout=5)
        assert chan.encrypted == encrypted
        chan.sock = _Recorder(chan.sock, recorded)
        chan.send(_hello(0))
        assert _event(server, CheckedIn).rank == 0
        assert (b'"type":"hello"' in recorded[0]) != encrypted
        with socket.create_connection(server.address, timeout=5) as raw:
            raw.recv(64)
            raw.sendall(b"\0" * 16 + recorded[0])  # a nonce of its own, then the recorded frame
            assert raw.recv(1) == b""
        assert _event(server, Refused).reason == "message authentication failed"
        chan.close()
        with pytest.raises(ConnectionError, match="says it is " + ("encrypted" if encrypted else "in clear")):
            channel.connect(server.address, server.secret, timeout=5, encrypted=not encrypted)
    finally:
        server.close()


class _Recorder:
    def __init__(self, sock, sink):
        self._sock, self._sink = sock, sink

    def sendall(self, data):
        self._sink.append(data)
        return self._sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_signed_messages_that_break_the_protocol_are_refused_and_the_run_goes_on(server, caplog):
    """A peer holding the secret whose first message is not a hello is refused before it counts as a
    rank; a rank that later sends what a rank may not (here the driver's ``abort``) is dropped,
    named; a well-formed rank's events are untouched."""
    from sparktrain.driver.supervise.server import Closed

    stranger = channel.connect(server.address, server.secret, timeout=5)
    stranger.send(protocol.Beat())
    assert _event(server, Refused).reason == "the first message was not a hello"
    assert server.missing_ranks() == [0, 1]
    rogue = channel.connect(server.address, server.secret, timeout=5)
    rogue.send(_hello(1, 1001))
    assert _event(server, CheckedIn).rank == 1
    rogue.send(protocol.Abort("not a rank's to send"))
    assert _event(server, Closed).rank == 1
    assert "dropped rank 1's connection: a rank sent a message of type 'abort'" in caplog.text
    good = channel.connect(server.address, server.secret, timeout=5)
    good.send(_hello(0))
    assert _event(server, CheckedIn).rank == 0
    failure = RankFailure(rank=0, host="127.0.0.1", local_rank=0, exc_type="ValueError", message="m",
                                   output_tail=("a", "b"), time=2.0)
    good.send(protocol.RankFailed(failure))
    assert _event(server, RankFailed) == RankFailed(failure)
    for c in (stranger, rogue, good):
        c.close()


def test_close_is_prompt_and_idempotent_with_idle_connections(server):
    idle = socket.create_connection(server.address, timeout=5)
    server.close()
    with pytest.raises(queue.Empty):
        while True:
            ev = server.events.get_nowait()
            assert isinstance(ev, Refused)
    idle.close()


def test_a_rank_that_goes_silent_is_reported_unreachable_but_one_that_said_quiet_is_not():
    """The liveness check on real sockets: the server beats every second; a rank that beat and then
    says nothing, its connection still open (a host cut off sends no reset), is a failure naming its
    host; a rank that said ``quiet`` (its process ended; the result follows) is left alone."""

    server = DriverServer(channel.new_secret(), size=2, host="127.0.0.1", heartbeat_timeout=1.5)
    try:
        a = channel.connect(server.address, server.secret, timeout=5)
        b = channel.connect(server.address, server.secret, timeout=5)
        a.send(_hello(0, 1000, "10.9.0.1"))
        b.send(_hello(1, 1001, "10.9.0.2"))
        kinds = set()
        while {protocol.Peers, protocol.Beat} - kinds:  # the server beats while ranks run
            kinds.add(type(b.recv()))
        a.send(protocol.Beat())
        b.send(protocol.Beat())
        b.send(protocol.Quiet())
        failed = _event(server, RankFailed, timeout=15)
        assert failed.failure.rank == 0 and failed.failure.exc_type == "HostUnreachable", failed
        assert "host 10.9.0.1 became unreachable: no word from rank 0" in failed.failure.message
        assert failed.failure.host == "10.9.0.1"
        with pytest.raises(queue.Empty):  # rank 1 is never reported, nor rank 0 twice
            _event(server, RankFailed, timeout=3)
        assert server.wait_disconnected(0.5) is False  # rank 1 is still connected...
        b.close()
        assert server.wait_disconnected(5)  # ...and nobody waits for the unreachable rank 0
        a.close()
    finally:
        server.close()
