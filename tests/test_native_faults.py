"""Faults of the native engine: a rank killed inside an allreduce, what is left behind, strangers.

Plain forked ranks (tests/native_ranks.py), no Spark.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import uuid

import pytest

from sparktrain import native

import native_ranks as nr

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not native.available(), reason=str(native.unavailable_reason()))]


@pytest.mark.parametrize("tcp", [False, True], ids=["shm", "tcp"])
def test_a_rank_killed_inside_an_allreduce_fails_the_others_naming_it(tcp):
    started = multiprocessing.get_context("fork").Event()
    name = f"test-kill-{uuid.uuid4().hex[:8]}"

    def kill_rank_2(procs):
        assert started.wait(60), "rank 2 never got into its allreduces"
        os.kill(procs[2].pid, signal.SIGKILL)

    results = nr.run_ranks(3, nr.allreduce_forever, 2, started, tcp=tcp, timeout=30, name=name,
                           on_start=kill_rank_2)
    assert sorted(results) == [0, 1], results  # rank 2 never reports
    for r, (status, text) in results.items():
        assert status == "error", (r, text)
        assert "CollectiveError" in text, (r, text)
    # Over shared memory both see rank 2's death. On the ring, rank 0 (whose previous leader is
    # rank 2) names it; rank 1 names rank 2 or rank 0, whichever connection broke first.
    assert "rank 2" in results[0][1], results[0][1]
    if not tcp:
        assert "rank 2" in results[1][1] and "died" in results[1][1], results[1][1]
    for node in range(3):
        assert not os.path.exists("/dev/shm" + native.segment_name(name, node))


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
    arrived = multiprocessing.get_context("fork").Barrier(3)
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
