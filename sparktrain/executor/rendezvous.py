"""Meeting the other ranks: every rank's host and ports, and its share of the fed DataFrames.

Through the driver's channel (one hello each, one answer from the driver), or, where executors
cannot reach the driver (Spark Connect), through one Spark barrier ``allGather``.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import hmac
import os
import secrets
import socket
import time
from typing import Callable

from ..seam import channel, protocol, versions
from ..errors import SparkTrainError, VersionMismatchError
from .link import Link
from .output import RankIO


def reserve_port(host: str = "", attempts: int = 64) -> socket.socket:
    """Bind a free TCP port and hold it, so nobody else takes it before the child needs it.

    The caller closes the socket right before starting the child ("late handover"); the
    child's collective runtime then binds the same port. The port is drawn at random from
    below the kernel's ephemeral range: between the handover and the child's bind, an
    outgoing connection of any process on the host (a JVM opens many) or another
    ``bind(("", 0))`` may be given an ephemeral port, and TensorFlow's gRPC server then fails
    with "Could not start gRPC server". Where no range lies below the ephemeral one, the kernel
    picks.
    """
    low, high = _unclaimed_range()
    last: OSError | None = None
    tries = attempts if high > low else 1
    for _ in range(tries):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((host, low + secrets.randbelow(high - low) if high > low else 0))
            return s
        except OSError as e:
            s.close()
            if e.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise
            last = e
    where = f"between {low} and {high}" if high > low else "from the kernel"
    raise OSError(errno.EADDRINUSE, f"no free port {where} after {tries} attempt(s): {last}")


def _unclaimed_range(floor: int = 10000, width: int = 16384) -> tuple[int, int]:
    """Ports no process is handed by the kernel: up to ``width`` of them below the ephemeral
    range (``net.ipv4.ip_local_port_range``), never below ``floor`` where services listen."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0, 0
    return max(floor, ephemeral_low - width), ephemeral_low


def check_versions(state: RankIO) -> None:
    """Fail this rank at once, with a readable diff, when its versions differ from the driver's."""
    if state.spec.versions is None:
        return
    diff = versions.mismatches(state.spec.versions, versions.collect())
    if diff:
        raise VersionMismatchError(
            f"rank {state.rank} on {state.host} runs other versions than the driver:\n  " + "\n  ".join(diff)
            + "\nInstall the same versions on the executors as on the driver (for example with the same "
            "requirements file or cluster library list)")

def rendezvous(state: RankIO, port: int, master_port: int, barrier_ctx, shard: dict[str, int],
               checked_in: Callable[[], None] = lambda: None,
               ) -> tuple[list[str], list[int], int, list[dict[str, int]]]:
    """Meet the other ranks: every rank's host and ports, and its row count per fed DataFrame.

    ``checked_in`` is called once this rank has said hello and its versions match, before it
    waits for the others (the task starts the rank's process there, held)."""
    me = protocol.CheckedIn(state.rank, state.host, port, master_port, os.getpid(), state.partition, shard)
    spec = state.spec
    if spec.driver_address is None:
        # One Spark barrier sync (about a second): the path for executors that cannot reach
        # the driver, such as under Spark Connect. With no driver secret, rank 0 makes the
        # collective key and shares it through the sync.
        check_versions(state)
        checked_in()
        if state.rank == 0:
            me = dataclasses.replace(me, collective_key=secrets.token_hex(32))
        hellos = [protocol.decode(m, protocol.RANK) for m in barrier_ctx.allGather(protocol.encode(me).decode())]
        peers = protocol.peers(hellos)
        state.collective_key = bytes.fromhex(next(h.collective_key for h in hellos if h.rank == 0))
        return list(peers.hosts), list(peers.ports), peers.master_port, list(peers.shards)
    state.collective_key = collective_key(spec.secret, spec.run_id, spec.attempt)
    state.link = Link(spec, state.rank, secrets.token_hex(16))
    try:
        state.link.open(timeout=min(30.0, spec.start_timeout))
    except OSError as e:
        state.link = None
        raise SparkTrainError(
            f"rank {state.rank} on {state.host} cannot reach the driver's channel at "
            f"{spec.driver_address[0]}:{spec.driver_address[1]}: {e}. If executors cannot open "
            "connections to the driver, set spark.sparktrain.rendezvous=barrier"
        ) from None
    state.send(dataclasses.replace(me, session=state.link.token))
    check_versions(state)  # after the hello, so the failure report reaches the driver at once
    checked_in()
    deadline = time.monotonic() + spec.start_timeout
    msg = protocol.Beat()
    while isinstance(msg, protocol.Beat):  # the driver's beats come every second until the peers do
        msg = state.link.next_message(deadline)
    if msg is None and state.link.gone:
        raise SparkTrainError(f"rank {state.rank}: the channel to the driver broke during rendezvous and did not "
                              "come back within heartbeat_timeout")
    if msg is None:
        raise SparkTrainError(
            f"rank {state.rank} waited {spec.start_timeout:.0f} s for the other ranks to start "
            "(start_timeout); see the driver's error for which ranks never started")
    if isinstance(msg, protocol.Abort):
        state.abort_reason = msg.reason
        raise SparkTrainError(f"rank {state.rank} was stopped before it started: {state.abort_reason}")
    if not isinstance(msg, protocol.Peers):
        raise SparkTrainError(f"rank {state.rank}: the driver answered its hello with a {msg.TYPE!r} message, "
                              "not the peers")
    return list(msg.hosts), list(msg.ports), msg.master_port, list(msg.shards)


def collective_key(secret: bytes, run_id: str, attempt: int) -> bytes:
    """The key of the ranks' collective connections, derived from the attempt's channel secret.

    The rank's process gets this derived key, never the channel's secret itself.
    """
    return hmac.new(secret, f"sparktrain-collective|{run_id}|{attempt}".encode(), hashlib.sha256).digest()
