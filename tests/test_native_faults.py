"""Faults of the native engine: a rank killed inside an allreduce, what is left behind, strangers.

Plain forked ranks (tests/native_ranks.py), no Spark.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import uuid

import pytest

from sparktrain import engine

import native_ranks as nr

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not engine.available(), reason=str(engine.unavailable_reason()))]


TWO_HOSTS_OF_TWO = ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"]


PIPELINED = 3 << 19  # float32: 6 MiB, pipelined across hosts (native/pipeline.c)


@pytest.mark.parametrize("n, tcp, hosts, victim, spin, size", [
    (3, False, None, 2, None, 1 << 18),
    (2, False, None, 1, 1.0, 1 << 18),           # the survivor spins a whole second per wait before it looks
    (3, True, None, 2, None, 1 << 18),
    (4, True, None, 2, None, 1 << 18),           # rank 0 is no neighbour of rank 2: word must come round the ring
    (4, False, TWO_HOSTS_OF_TWO, 3, None, 1 << 18),  # a non-leader: its leader sees it over shared memory, host 0
                                                     # over the ring
    (4, False, TWO_HOSTS_OF_TWO, 2, None, 1 << 18),  # a leader: host 0's leader sees its connection close, rank 3
                                                     # its death
    (4, False, TWO_HOSTS_OF_TWO, 3, None, PIPELINED),  # its leader's main thread sees it and calls its ring off
    (4, False, TWO_HOSTS_OF_TWO, 2, None, PIPELINED),  # host 0's ring thread sees it, its main thread takes that
], ids=["shm3", "shm2-spinning", "tcp3", "tcp4", "hosts-nonleader", "hosts-leader", "pipelined-nonleader",
        "pipelined-leader"])
def test_a_rank_killed_inside_an_allreduce_fails_every_other_naming_it(n, tcp, hosts, victim, spin, size):
    started = nr.CONTEXT.Event()
    name = f"test-kill-{uuid.uuid4().hex[:8]}"
    timeout = 30

    def kill_victim(procs):
        assert started.wait(60), "the victim never got into its allreduces"
        os.kill(procs[victim].pid, signal.SIGKILL)

    results = nr.run_ranks(n, nr.allreduce_until_it_fails, victim, started, size, tcp=tcp, hosts=hosts, timeout=timeout,
                           name=name, on_start=kill_victim, spin=spin)
    survivors = [r for r in range(n) if r != victim]
    assert sorted(results) == survivors, results  # the victim never reports
    for r in survivors:
        status, v = results[r]
        assert status == "ok", (r, v)
        # A peer failure naming the victim, and no other rank: not a neighbour whose socket closed.
        assert v["code"] == engine.PEER, (r, v)
        assert set(re.findall(r"\brank (\d+)", v["message"])) == {str(victim)}, (r, v["message"])
        assert v["took"] < timeout, (r, v)
        assert v["sockets"] == [], (r, v)  # nothing listening, no ring connection left open
    for node in range(n):
        assert not os.path.exists("/dev/shm" + engine.segment_name(name, node))


def test_a_rank_that_closes_early_is_named_not_taken_for_dead():
    # Over the ring a communicator closed in good order says so upstream before its sockets
    # close: the others name it as having closed, within the timeout, not as dead.
    results = nr.run_ranks(3, nr.one_rank_leaves_early, 2, tcp=True, timeout=30)
    assert results[2] == ("ok", "left"), results
    for r in (0, 1):
        status, v = results[r]
        assert status == "ok" and isinstance(v, dict), (r, v)
        assert v["code"] == engine.PEER, (r, v)
        assert "rank 2 closed its communicator" in v["message"], (r, v)


def _inspect(comm, name):
    return {"listening": nr.listening_sockets(comm), "segment": nr.segment_left(comm, name),
            "sum": float(comm.allreduce(nr.np.ones(3, nr.np.float32), "sum")[0])}


@pytest.mark.parametrize("tcp", [False, True], ids=["shm", "tcp"])
def test_nothing_is_left_listening_or_linked_once_set_up(tcp):
    name = f"test-left-{uuid.uuid4().hex[:8]}"
    values = nr.all_ok(nr.run_ranks(3, _inspect, name, tcp=tcp, name=name), 3)
    for r, v in values.items():
        assert v == {"listening": [], "segment": False, "sum": 3.0}, (r, v)


def _strangers(port: int) -> list[socket.socket]:
    """Connections to rank 0's port from someone without the secret, queued before the ranks start."""
    import hashlib
    import hmac
    import struct

    out = []
    junk = socket.create_connection((nr.LOOPBACK, port))
    junk.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 80)
    out.append(junk)
    forged = socket.create_connection((nr.LOOPBACK, port))
    out.append(forged)
    # A well-formed answer, but keyed with the wrong secret; it claims to be rank 1.
    r = struct.pack("!i", 1)
    forged.sendall(r + b"\0" * 32 + hmac.new(b"wrong", b"x", hashlib.sha256).digest())
    return out


def _received_until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(60)
    data = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def test_a_stranger_without_the_secret_is_refused_and_the_run_goes_on():
    listener = socket.socket()
    listener.bind((nr.LOOPBACK, 0))
    listener.listen(8)
    strangers = _strangers(listener.getsockname()[1])
    values = nr.all_ok(nr.run_ranks(2, nr.correctness, (7, 1024), ("float32",), tcp=True, listeners={0: listener}), 2)
    listener.close()
    assert all(v["bad"] == [] for v in values.values())
    for s in strangers:
        got = _received_until_closed(s)
        # The stranger saw the challenge, then the door closed: no acceptance, no data.
        assert got.startswith(b"STC1") and len(got) == 36, got
        s.close()


@pytest.mark.parametrize("tcp", [False, True], ids=["shm", "tcp"])
def test_a_rank_that_never_calls_makes_the_others_time_out(tcp):
    arrived = nr.CONTEXT.Barrier(3)
    results = nr.run_ranks(3, nr.one_rank_never_comes, 2, arrived, tcp=tcp, timeout=2)
    assert results[2] == ("ok", "never called"), results
    for r in (0, 1):
        status, text = results[r]
        assert status == "error" and "CollectiveError" in text, (r, text)
    if not tcp:  # over shared memory both name the rank they waited for
        assert all("rank 2" in results[r][1] for r in (0, 1)), results
    assert any("timed out" in results[r][1] for r in (0, 1)), results


def test_allgather_of_different_trailing_shapes_is_an_error():
    results = nr.run_ranks(2, nr.gather_mismatched_shapes)
    for r, (status, text) in results.items():
        assert status == "error" and "only the first dimension may differ" in text, (r, text)
