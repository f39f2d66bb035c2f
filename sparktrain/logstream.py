"""The run's authenticated channel between the driver and every rank.

It carries the rendezvous (ranks say hello, the driver answers with everyone's address),
every rank's output lines, failure reports and stop orders. Messages are JSON; nothing
that travels on it is ever unpickled.

Authentication: the driver opens each connection with a fresh random nonce. Both ends derive
a connection key ``HMAC(secret, nonce)`` from the run's secret, and every frame carries
``HMAC(key, direction || sequence number || body)``. The receiver checks that MAC with a
constant-time compare before it parses anything, so a peer without the secret cannot inject,
replay or reorder messages. A peer that fails the check is dropped and the run goes on.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import queue
import secrets
import socket
import struct
import threading
from typing import Any

log = logging.getLogger("sparktrain")

_MAGIC = b"SPKT1"
_NONCE_BYTES = 16
_MAC_BYTES = 32
_HEADER = struct.Struct("!I")
#: Largest frame accepted. Output lines are cut far below this; it bounds what an
#: unauthenticated peer can make us buffer.
MAX_FRAME = 1 << 20
#: How long a new connection may take to prove it holds the secret.
AUTH_TIMEOUT = 10.0


class AuthenticationError(Exception):
    pass


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class Channel:
    """One authenticated, framed connection. ``send`` is thread-safe; ``recv`` is for one reader."""

    def __init__(self, sock: socket.socket, key: bytes, *, is_server: bool):
        self.sock = sock
        self._key = key
        self._out_dir = b"s" if is_server else b"c"
        self._in_dir = b"c" if is_server else b"s"
        self._out_seq = 0
        self._in_seq = 0
        self._send_lock = threading.Lock()
        self.closed = False

    def _mac(self, direction: bytes, seq: int, body: bytes) -> bytes:
        return hmac.new(self._key, direction + seq.to_bytes(8, "big") + body, hashlib.sha256).digest()

    def send(self, msg: dict[str, Any]) -> None:
        body = json.dumps(msg, separators=(",", ":")).encode()
        if len(body) > MAX_FRAME:
            raise ValueError(f"message of {len(body)} bytes exceeds the channel's {MAX_FRAME} byte frame limit")
        with self._send_lock:
            mac = self._mac(self._out_dir, self._out_seq, body)
            self._out_seq += 1
            self.sock.sendall(_HEADER.pack(len(body)) + mac + body)

    def recv(self) -> dict[str, Any] | None:
        """The next message, or None when the peer closed. Raises AuthenticationError on a bad MAC."""
        header = _recv_exact(self.sock, _HEADER.size)
        if header is None:
            return None
        (length,) = _HEADER.unpack(header)
        if length > MAX_FRAME:
            raise AuthenticationError(f"frame of {length} bytes is over the {MAX_FRAME} byte limit")
        mac = _recv_exact(self.sock, _MAC_BYTES)
        body = _recv_exact(self.sock, length) if mac is not None else None
        if body is None:
            return None
        # Verify before parsing: nothing from an unauthenticated peer reaches json (or anything else).
        if not hmac.compare_digest(mac, self._mac(self._in_dir, self._in_seq, body)):
            raise AuthenticationError("message authentication failed")
        self._in_seq += 1
        return json.loads(body)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _connection_key(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, b"sparktrain-connection" + nonce, hashlib.sha256).digest()


def connect(address: tuple[str, int], secret: bytes, timeout: float) -> Channel:
    """Open a channel to the driver (rank side). Raises OSError when it cannot be reached."""
    sock = socket.create_connection(address, timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        greeting = _recv_exact(sock, len(_MAGIC) + _NONCE_BYTES)
        if greeting is None or not greeting.startswith(_MAGIC):
            raise ConnectionError(f"{address[0]}:{address[1]} is not a sparktrain driver channel")
        sock.settimeout(None)
        return Channel(sock, _connection_key(secret, greeting[len(_MAGIC):]), is_server=False)
    except BaseException:
        sock.close()
        raise


class DriverServer:
    """The driver's end: accepts ranks, does the rendezvous, and turns what ranks send into events.

    Events go to ``self.events`` (a queue) as tuples the launcher consumes on its own thread,
    so output is written from the thread that called ``run`` (which is what notebooks show
    in the running cell):

    - ``("hello", rank, info)``, ``("out", rank, stream, line, time)``,
    - ``("failed", rank, failure_dict)``, ``("exited", rank, exitcode)``, ``("closed", rank)``,
    - ``("refused", peer, reason)`` for a connection that did not authenticate.
    """

    def __init__(self, secret: bytes, size: int, host: str):
        self.secret = secret
        self.size = size
        self.events: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._channels: dict[int, Channel] = {}
        self._hellos: dict[int, dict] = {}
        self._closing = False
        self._abort_reason: str | None = None
        self._threads: list[threading.Thread] = []
        self._pending: set[socket.socket] = set()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(max(16, 2 * size))
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self._accept_thread = threading.Thread(target=self._accept_loop, name="sparktrain-accept", daemon=True)
        self._accept_thread.start()

    # -- connections ---------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return  # listener closed
            with self._lock:
                if self._closing:
                    sock.close()
                    return
                self._pending.add(sock)
                t = threading.Thread(target=self._serve, args=(sock, peer), name="sparktrain-conn", daemon=True)
                self._threads.append(t)
            t.start()

    def _serve(self, sock: socket.socket, peer) -> None:
        rank = None
        chan = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = os.urandom(_NONCE_BYTES)
            sock.sendall(_MAGIC + nonce)
            chan = Channel(sock, _connection_key(self.secret, nonce), is_server=True)
            sock.settimeout(AUTH_TIMEOUT)
            hello = chan.recv()
            if hello is None or hello.get("type") != "hello":
                raise AuthenticationError("the first message was not a hello")
            sock.settimeout(None)
            rank = int(hello["rank"])
            if not self._register(rank, chan, hello):
                return
            while True:
                msg = chan.recv()
                if msg is None:
                    break
                self._dispatch(rank, msg)
        except (AuthenticationError, socket.timeout, ValueError, KeyError) as e:
            if rank is None:
                self.events.put(("refused", peer[0], str(e)))  # the launcher logs it, once
            else:
                log.warning("sparktrain: dropped rank %d's connection: %s", rank, e)
        except OSError:
            pass  # the peer went away; the launcher learns what happened from Spark or other events
        finally:
            with self._lock:
                self._pending.discard(sock)
            if chan is not None:
                chan.close()
            else:
                sock.close()
            if rank is not None:
                self.events.put(("closed", rank))

    def _register(self, rank: int, chan: Channel, hello: dict) -> bool:
        with self._lock:
            if not 0 <= rank < self.size or rank in self._hellos or self._closing or self._abort_reason:
                # A second hello for a rank is a retried Spark task; sparktrain does not retry
                # inside a stage, so that attempt is told to stop at once. A rank that starts
                # after the run was stopped is told so too.
                why = ("duplicate rank" if rank in self._hellos else "unknown rank") + \
                    f" {rank}: this run does not accept it"
                self._send_quietly(chan, {"type": "abort", "reason": self._abort_reason or why})
                return False
            self._channels[rank] = chan
            self._hellos[rank] = hello
            complete = len(self._hellos) == self.size
        self.events.put(("hello", rank, hello))
        if complete:
            self._send_peers()
        return True

    def _send_peers(self) -> None:
        with self._lock:
            ordered = [self._hellos[r] for r in range(self.size)]
            peers = {
                "type": "peers",
                "hosts": [h["host"] for h in ordered],
                "ports": [int(h["port"]) for h in ordered],
                "master_port": int(ordered[0]["master_port"]),
            }
            channels = list(self._channels.values())
        for chan in channels:
            self._send_quietly(chan, peers)

    def _dispatch(self, rank: int, msg: dict) -> None:
        kind = msg.get("type")
        if kind == "out":
            self.events.put(("out", rank, msg["stream"], msg["line"], msg["time"]))
        elif kind == "failed":
            self.events.put(("failed", rank, msg["failure"]))
        elif kind == "exited":
            self.events.put(("exited", rank, msg.get("exitcode")))

    @staticmethod
    def _send_quietly(chan: Channel, msg: dict) -> None:
        try:
            chan.send(msg)
        except OSError:
            pass

    # -- control -------------------------------------------------------------------------------
    def missing_ranks(self) -> list[int]:
        with self._lock:
            return [r for r in range(self.size) if r not in self._hellos]

    def connected_ranks(self) -> list[int]:
        with self._lock:
            return [r for r, c in self._channels.items() if not c.closed]

    def abort(self, reason: str) -> None:
        """Tell every connected rank to stop its processes now, and every later one not to start."""
        with self._lock:
            self._abort_reason = self._abort_reason or reason
            channels = list(self._channels.values())
        for chan in channels:
            self._send_quietly(chan, {"type": "abort", "reason": reason})

    def close(self) -> None:
        with self._lock:
            self._closing = True
            channels = list(self._channels.values())
            pending = list(self._pending)
        try:
            # shutdown() wakes the accept() blocked in the accept thread; close() alone does not.
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for chan in channels:
            chan.close()
        for sock in pending:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._accept_thread.join(timeout=5)
        for t in self._threads:
            t.join(timeout=5)
