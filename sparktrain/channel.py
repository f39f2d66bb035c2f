"""The run's authenticated channel between the driver and every rank: framing and HMAC.

Pure and shared: the driver's server (``sparktrain.driver.server``) and each rank
(``sparktrain.executor.task``) speak it. It carries the rendezvous (ranks say hello, the driver
answers with everyone's address), every rank's output lines, beats, failure reports and stop
orders: the messages of ``sparktrain.protocol``, each encoded there as one JSON object. Nothing
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
import os
import secrets
import socket
import struct
import threading
from . import protocol
from .errors import SparkTrainError

_MAGIC = b"SPKT1"
_NONCE_BYTES = 16
_MAC_BYTES = 32
_HEADER = struct.Struct("!I")
#: Largest frame accepted. Output lines are cut far below this; it bounds what an
#: unauthenticated peer can make us buffer.
MAX_FRAME = 1 << 20
#: How long a new connection may take to prove it holds the secret.
AUTH_TIMEOUT = 10.0
#: Seconds between the ``beat`` messages each end sends while a rank runs, so that silence means
#: the other end or the network between is gone (``heartbeat_timeout``).
BEAT_SECONDS = 1.0


class AuthenticationError(SparkTrainError):
    """A message whose signature does not check out: it is dropped, never unpickled."""


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
    """One authenticated, framed connection. ``send`` is thread-safe; ``recv`` is for one reader.

    The driver's end (``is_server``) reads what a rank sends, a rank's end what the driver sends."""

    def __init__(self, sock: socket.socket, key: bytes, *, is_server: bool):
        self.sock = sock
        self._key = key
        self._out_dir = b"s" if is_server else b"c"
        self._in_dir = b"c" if is_server else b"s"
        self._sender = protocol.RANK if is_server else protocol.DRIVER
        self._out_seq = 0
        self._in_seq = 0
        self._send_lock = threading.Lock()
        self.closed = False

    def _mac(self, direction: bytes, seq: int, body: bytes) -> bytes:
        return hmac.new(self._key, direction + seq.to_bytes(8, "big") + body, hashlib.sha256).digest()

    def send(self, msg: protocol.Message) -> None:
        body = protocol.encode(msg)
        if len(body) > MAX_FRAME:
            raise ValueError(f"message of {len(body)} bytes exceeds the channel's {MAX_FRAME} byte frame limit")
        with self._send_lock:
            mac = self._mac(self._out_dir, self._out_seq, body)
            self._out_seq += 1
            self.sock.sendall(_HEADER.pack(len(body)) + mac + body)

    def recv(self) -> protocol.Message | None:
        """The next message, or None when the peer closed. Raises AuthenticationError on a bad MAC,
        ``protocol.ProtocolError`` on a signed message that is not one the peer may send."""
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
        return protocol.decode(body, self._sender)

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


def accept(sock: socket.socket, secret: bytes) -> Channel:
    """Open the driver's end of a new connection: greet it with a fresh nonce (driver side)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    nonce = os.urandom(_NONCE_BYTES)
    sock.sendall(_MAGIC + nonce)
    return Channel(sock, _connection_key(secret, nonce), is_server=True)
