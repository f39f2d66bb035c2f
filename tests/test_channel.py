"""The driver channel admits only peers holding the run's secret, and checks before parsing; a
rank's session outlives its connection, and only that rank can carry it on."""
import queue
import socket
import time

import pytest

from sparktrain.seam import channel, protocol, session
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


def _hello(rank, port=1000, host="127.0.0.1", token=None):
    return protocol.CheckedIn(rank=rank, host=host, port=port, master_port=9, pid=1, session=token)


class Peer:
    """A rank's end of the channel as the driver's server expects it: every frame numbered and
    acknowledging (``sparktrain.seam.session``), on a real connection."""

    def __init__(self, server, secret=None, encrypted=None, sess=None):
        self.chan = channel.connect(server.address, secret or server.secret, timeout=5, encrypted=encrypted)
        self.chan.sock.settimeout(15)
        self.session = sess or session.Session()

    @property
    def sock(self):
        return self.chan.sock

    def send(self, msg, numbered=True):
        self.chan.send_encoded(self.session.wrap(protocol.encode(msg), numbered))

    def recv(self, beats=False):
        """The driver's next new message (beats passed over unless ``beats``); None once it closed."""
        while True:
            body = self.chan.recv_body()
            if body is None:
                return None
            seq, ack, payload = session.split(body)
            msg = self.chan.decode(payload)
            if self.session.take(seq, ack) and (beats or not isinstance(msg, protocol.Beat)):
                return msg

    def close(self):
        self.chan.close()


def test_rendezvous_and_output(server):
    a, b = Peer(server), Peer(server)
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
    bad = Peer(server, secret=b"x" * 32)
    bad.send(_hello(0))
    assert _event(server, Refused).reason == "message authentication failed"
    assert bad.sock.recv(1) == b""  # dropped
    good = Peer(server)
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
        chan = Peer(server)
        assert chan.chan.encrypted == encrypted
        chan.chan.sock = _Recorder(chan.sock, recorded)
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

    stranger = Peer(server)
    stranger.send(protocol.Beat())
    assert _event(server, Refused).reason == "the first message was not a hello"
    assert server.missing_ranks() == [0, 1]
    rogue = Peer(server)
    rogue.send(_hello(1, 1001))
    assert _event(server, CheckedIn).rank == 1
    rogue.send(protocol.Abort("not a rank's to send"))
    assert _event(server, Closed).rank == 1
    assert "dropped rank 1's connection: a rank sent a message of type 'abort'" in caplog.text
    good = Peer(server)
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
        a, b = Peer(server), Peer(server)
        a.send(_hello(0, 1000, "10.9.0.1"))
        b.send(_hello(1, 1001, "10.9.0.2"))
        kinds = set()
        while {protocol.Peers, protocol.Beat} - kinds:  # the server beats while ranks run
            kinds.add(type(b.recv(beats=True)))
        a.send(protocol.Beat(), numbered=False)
        b.send(protocol.Beat(), numbered=False)
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


# -- sessions across connections (sparktrain.seam.session) ------------------------------------------

def test_a_session_numbers_keeps_and_passes_over_what_was_received():
    ours, theirs = session.Session(), session.Session()
    frames = [ours.wrap(b"a"), ours.wrap(b"beat", numbered=False), ours.wrap(b"b")]
    got = []
    for f in frames[:2]:
        seq, ack, body = session.split(f)
        if theirs.take(seq, ack):
            got.append(body)
    assert got == [b"a", b"beat"] and ours.pending == 2
    reply = theirs.wrap(b"x", numbered=False)  # acknowledges "a"
    assert ours.take(*session.split(reply)[:2]) and ours.pending == 1
    again = ours.unacknowledged(0) + frames[2:]  # "b" sent again across a break, and once more
    for f in again:
        seq, ack, body = session.split(f)
        if theirs.take(seq, ack):
            got.append(body)
    assert got == [b"a", b"beat", b"b"]
    with pytest.raises(protocol.ProtocolError, match="message 5 arrived after message 2"):
        theirs.take(5, 0)
    with pytest.raises(protocol.ProtocolError, match="acknowledged message 9, but only 2 were sent"):
        ours.take(0, 9)


def _resume(peer, rank, token, attempt=1):
    """Resume ``rank``'s session on ``peer``: the driver's first frame (None: it refused, closing)."""
    peer.send(protocol.Resume(rank, attempt, token), numbered=False)
    body = peer.chan.recv_body()
    if body is None:
        return None
    seq, ack, payload = session.split(body)
    peer.session.take(seq, ack)
    for frame in peer.session.unacknowledged(ack):
        peer.chan.send_encoded(frame)
    return peer.chan.decode(payload)


def _reset(peer):
    """End ``peer``'s connection with a reset, as a middlebox that dropped the flow does."""
    import struct

    peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    peer.close()


def _lines(server, n, timeout=15.0):
    got = []
    while len(got) < n:
        got.append(_event(server, Output, timeout).line)
    return got


def test_a_broken_connection_resumes_its_session_and_nothing_is_lost_or_shown_twice():
    """A rank's connection is reset after some lines, with more in flight; the driver tells it to
    stop while it is away. On a new connection it resumes its session: the driver says it came
    back, shows every line once and in order, and the stop order reaches the rank."""
    from sparktrain.driver.supervise.server import Closed, Rejoined

    server = DriverServer(channel.new_secret(), size=1, host="127.0.0.1", heartbeat_timeout=8.0)
    try:
        token = "ab" * 16
        a = Peer(server)
        a.send(_hello(0, token=token))
        assert isinstance(a.recv(), protocol.Peers)
        a.send(protocol.Output("stdout", "line 0", 1.0))
        a.send(protocol.Output("stdout", "line 1", 1.0))
        assert _lines(server, 2) == ["line 0", "line 1"]
        a.send(protocol.Output("stdout", "line 2", 1.0))  # the driver may have it or not: never acknowledged
        kept = a.session
        assert kept.pending >= 1
        _reset(a)
        server.abort("stop while away")
        b = Peer(server, sess=kept)
        assert _resume(b, 0, token) == protocol.Resumed()
        b.send(protocol.Output("stdout", "line 3", 1.0))
        assert b.recv() == protocol.Abort("stop while away")
        b.send(protocol.Output("stdout", "line 4", 1.0))
        events = []
        while not events or getattr(events[-1], "line", None) != "line 4":
            events.append(_event(server, (Output, Closed, Rejoined)))
        assert [e.line for e in events if isinstance(e, Output)] == ["line 2", "line 3", "line 4"]
        assert [type(e) for e in events if not isinstance(e, Output)] == [Closed, Rejoined]
        b.close()
    finally:
        server.close()


def test_a_resume_without_the_secret_or_for_a_connected_rank_or_another_session_is_refused():
    """Only the rank itself can carry its session on: a resume for a rank whose connection is up
    (it beats), naming another session or attempt, or signed without the run's secret, is refused
    and dropped, and the rank's own connection goes on."""
    server = DriverServer(channel.new_secret(), size=1, host="127.0.0.1", heartbeat_timeout=8.0, attempt=2)
    try:
        token = "cd" * 16
        a = Peer(server)
        a.send(_hello(0, token=token))
        assert isinstance(a.recv(), protocol.Peers)
        a.send(protocol.Beat(), numbered=False)
        for secret, resume, says in [
            (None, protocol.Resume(0, 2, token), "a resume for rank 0, which is connected"),
            (None, protocol.Resume(0, 2, "ef" * 16), "a resume for rank 0 that names no session of this run"),
            (None, protocol.Resume(0, 1, token), "a resume for attempt 1; this is attempt 2"),
            (None, protocol.Resume(3, 2, token), "a resume for rank 3 that names no session of this run"),
            (b"y" * 32, protocol.Resume(0, 2, token), "message authentication failed"),
        ]:
            stranger = Peer(server, secret=secret)
            stranger.send(resume, numbered=False)
            assert stranger.chan.recv_body() is None  # dropped, unanswered
            assert _event(server, Refused).reason == says
            stranger.close()
        a.send(protocol.Output("stdout", "still here", 1.0))
        assert _event(server, Output).line == "still here"
        assert server.connected_ranks() == [0]
        a.close()
    finally:
        server.close()


def test_a_rank_that_does_not_come_back_within_heartbeat_timeout_is_reported_unreachable():
    server = DriverServer(channel.new_secret(), size=1, host="127.0.0.1", heartbeat_timeout=1.5)
    try:
        a = Peer(server)
        a.send(_hello(0, host="10.9.0.3", token="01" * 16))
        assert isinstance(a.recv(), protocol.Peers)
        a.send(protocol.Beat(), numbered=False)
        _reset(a)
        failed = _event(server, RankFailed, timeout=15)
        assert failed.failure.exc_type == "HostUnreachable" and failed.failure.rank == 0, failed
        assert "host 10.9.0.3 became unreachable: no word from rank 0" in failed.failure.message
        assert "its channel dropped" in failed.failure.message and "did not reconnect" in failed.failure.message
    finally:
        server.close()


def _read_until(link, done, timeout=20.0):
    """Read the link's messages until ``done()``, for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the link did not get there in time"
        link.next_message(min(deadline, time.monotonic() + 0.5))


def _next(link, timeout=15.0):
    """The link's next message but beats."""
    deadline = time.monotonic() + timeout
    msg = protocol.Beat()
    while isinstance(msg, protocol.Beat):
        msg = link.next_message(deadline)
    return msg


def _spec(server, heartbeat_timeout):
    from sparktrain.seam.spec import TaskSpec

    return TaskSpec(run_id="link", size=1, payload=b"", secret=server.secret, driver_address=server.address,
                    use_gpu=False, output_ranks=None, max_result_bytes=0, start_timeout=30.0, grace_period=1.0,
                    user_env={}, heartbeat_timeout=heartbeat_timeout, encrypted=server.encrypted)


@pytest.mark.parametrize("encrypted", [False, True], ids=["clear", "encrypted"])
def test_the_ranks_link_reconnects_in_its_mode_and_gives_up_once_the_driver_is_gone(encrypted):
    """The rank's end (``executor.link``) on a real server: its connection ended by the driver's
    side, it reconnects by itself (encrypted where the run is), says nothing twice and loses
    nothing; once the driver is gone for good it gives up after heartbeat_timeout, and then says so."""
    from sparktrain.driver.supervise.server import Rejoined
    from sparktrain.driver.supervise.ranklinks import end
    from sparktrain.executor.link import Link

    server = DriverServer(channel.new_secret(), size=1, host="127.0.0.1", heartbeat_timeout=2.0, encrypted=encrypted)
    link = Link(_spec(server, 2.0), 0, "12" * 16)
    try:
        link.open(5)
        assert link.send(_hello(0, token=link.token))
        assert isinstance(_next(link), protocol.Peers)
        first = link.chan
        end(server._links[0].chan)  # the driver's end of the connection goes
        assert link.send(protocol.Output("stdout", "across", 1.0))
        _read_until(link, lambda: link.chan not in (None, first))  # reading, it finds the end, and reconnects
        assert _event(server, Rejoined).rank == 0
        assert link.chan.encrypted == encrypted
        server.abort("then stop")
        assert _next(link) == protocol.Abort("then stop")
        assert _event(server, Output).line == "across"
        assert link.settle(10)
        server.close()  # the driver is gone: every reconnect is refused
        _read_until(link, lambda: link.gone)
        assert link.send(protocol.Output("stdout", "nowhere", 1.0)) is False
    finally:
        link.close(1)
        server.close()
