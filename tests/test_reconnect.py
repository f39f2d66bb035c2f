"""A reset on the way, on local[2] with real ranks and sockets: the run's channel connections are
destroyed mid-run (``ss -K`` on the run's own port, as a load balancer or a NAT that drops a flow
sends a reset). Each rank reconnects and its session goes on: every line of every rank reaches the
driver once and in order, the driver says whose channel dropped and came back, a reset run still
stops at its timeout and leaves no process or directory behind, an encrypted channel reconnects
encrypted, and a stranger's resume without the secret is refused while the run goes on.
"""
from __future__ import annotations

import glob
import io
import logging
import os
import socket
import tempfile
import threading

import pytest

import resets
import sparktrain
from conftest import module_spark
from helpers import mark_time, rank_processes, read_ranks, record_rank, run_marker, wait_for_file, wait_for_ranks
from sparktrain.seam import channel, protocol, session

WHY_NOT = resets.why_not()
pytestmark = [pytest.mark.spark, pytest.mark.timeout(240),
              pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]

spark = module_spark("local[2]")

#: Lines each rank prints, and how many of them before the reset.
LINES, BEFORE = 30, 9


def print_through_a_reset(outdir, hang):
    """Prints BEFORE lines, says it is up, waits for the test's reset, prints the rest; then
    returns its rank, or (``hang``) waits for a file that never comes."""
    import sparktrain

    r = sparktrain.rank()
    for i in range(BEFORE):
        print(f"rank {r} line {i}", flush=True)
    record_rank(outdir)
    wait_for_file(os.path.join(outdir, "reset"), timeout=150)
    for i in range(BEFORE, LINES):
        print(f"rank {r} line {i}", flush=True)
    mark_time(outdir, f"printed-{r}")
    if hang:
        wait_for_file(os.path.join(outdir, "never"), timeout=600)
    return r


def _reset_when_up(outdir: str, found: dict, only: int | None = None, probe: bool = False) -> threading.Thread:
    """A started thread: once both ranks are up, it destroys the run's channel connections (both
    ends; with ``only``, that rank's alone), then lets the ranks print on. ``probe``: first a
    stranger without the secret tries to resume rank 0's session."""
    before = resets.listening_ports()

    def go():
        try:
            wait_for_ranks(outdir, 2, 120)
            (port,) = resets.listening_ports() - before  # the run's channel: the one new listener
            address = found["address"] = resets.listening_address(port)
            if probe:
                found["stranger"] = _stranger_resumes(address)
            peer = None if only is None else resets.connection_port(read_ranks(outdir)[only]["ppid"], address)
            found["killed"] = resets.reset(address, peer)
        finally:
            open(os.path.join(outdir, "reset"), "w").close()

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def _stranger_resumes(address) -> bool:
    """A resume of rank 0's session signed with another secret: True when the driver drops it."""
    bad = channel.connect(address, b"not the run's secret".ljust(32, b"!"), timeout=15)
    try:
        hello = session.Session().wrap(protocol.encode(protocol.Resume(0, 1, "00" * 16)), numbered=False)
        bad.send_encoded(hello)
        bad.sock.settimeout(15)
        try:
            return bad.sock.recv(1) == b""
        except ConnectionResetError:
            return True
    finally:
        bad.close()


def _lines_of(out: str, rank: int) -> list[str]:
    prefix = f"[{rank}]<stdout>:"
    return [line[len(prefix):] for line in out.splitlines() if line.startswith(prefix)]


def _rejoined(caplog, rank: int) -> int:
    return caplog.text.count(f"rank {rank}'s channel to the driver dropped and came back after")


def _left_behind(outdir: str) -> tuple[list[int], list[str]]:
    info = read_ranks(outdir)[0]
    marker = run_marker(info)
    return rank_processes(marker, timeout=30), glob.glob(os.path.join(tempfile.gettempdir(), marker + "r*"))


def test_a_reset_mid_run_loses_no_line_and_the_run_still_stops_at_its_timeout(spark, tmp_path, caplog):
    """Both ranks' connections destroyed, both ends, while the ranks print: each reconnects; every
    line of both reaches the driver once, in order; the driver says each came back; the run's
    timeout still stops it, and no rank process or work directory is left."""
    caplog.set_level(logging.WARNING, logger="sparktrain")
    outdir, found, out = str(tmp_path), {}, io.StringIO()
    thread = _reset_when_up(outdir, found)
    try:
        with pytest.raises(sparktrain.RunTimeoutError, match="timeout=40"):
            sparktrain.run(print_through_a_reset, args=(outdir, True), num_proc=2, timeout=40, stdout=out,
                           stderr=out, verbose=0)
    finally:
        thread.join(60)
    host, port = found["address"]
    assert len(found["killed"]) >= 2 and all(f":{port}" in line for line in found["killed"]), found
    for r in (0, 1):
        assert (tmp_path / f"printed-{r}").exists()
        assert _lines_of(out.getvalue(), r) == [f"rank {r} line {i}" for i in range(LINES)], out.getvalue()
        assert _rejoined(caplog, r) == 1, caplog.text
    assert _left_behind(outdir) == ([], [])


def test_an_encrypted_channel_reconnects_encrypted_one_rank_at_a_time_and_a_stranger_is_refused(spark, tmp_path,
                                                                                                caplog):
    """An encrypted run: a stranger without the secret tries to resume rank 0's session and is
    dropped; then rank 1's connection alone is destroyed. Rank 1 reconnects (encrypted: a rank
    refuses a channel in clear where the run asked for encryption), rank 0 is untouched, every line
    arrives once and in order, and the run returns its value."""
    caplog.set_level(logging.INFO, logger="sparktrain")
    outdir, found, out = str(tmp_path), {}, io.StringIO()
    thread = _reset_when_up(outdir, found, only=1, probe=True)
    try:
        result = sparktrain.run(print_through_a_reset, args=(outdir, False), num_proc=2, timeout=120,
                                encryption="on", stdout=out, stderr=out, verbose=1)
    finally:
        thread.join(60)
    assert result == 0
    assert found["stranger"] is True
    assert "refused a connection" in caplog.text and "message authentication failed" in caplog.text
    assert found["killed"] and all(f":{found['address'][1]}" in line for line in found["killed"]), found
    for r in (0, 1):
        assert _lines_of(out.getvalue(), r) == [f"rank {r} line {i}" for i in range(LINES)], out.getvalue()
    assert (_rejoined(caplog, 0), _rejoined(caplog, 1)) == (0, 1), caplog.text
    assert "encrypted (AES-256-GCM between hosts and on the driver's channel)" in caplog.text
    with pytest.raises(ConnectionRefusedError):  # the channel closed with the run
        socket.create_connection(found["address"], timeout=5).close()
    assert _left_behind(outdir) == ([], [])
