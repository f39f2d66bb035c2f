"""The run's authenticated channel between the driver and every rank: framing and HMAC.

Pure and shared: the driver's server (``sparktrain.driver.supervise.server``) and each rank
(``sparktrain.executor.task``) speak it. It carries the rendezvous (ranks say hello, the driver
answers with everyone's address), every rank's output lines, beats, failure reports and stop
orders: the messages of ``sparktrain.seam.protocol``, each encoded there as one JSON object. Nothing
that travels on it is ever unpickled.

Authentication and encryption: the driver opens each connection with a fresh random nonce and
says whether the channel is encrypted; the rank answers with a fresh nonce of its own. Both ends
derive a key per direction with HKDF-SHA256 (``sparktrain.seam.crypto``) from the run's secret (new
for every attempt), salted with both nonces, with the mode and the direction as its info. In
clear, every frame carries ``HMAC(key, sequence number || body)``; encrypted, every frame is
AES-256-GCM under the direction's key, its nonce the key's nonce base XOR the sequence number,
its sequence number and length authenticated. Either way the receiver checks the frame before
it parses anything, so a peer without the secret cannot read (when encrypted), inject, replay
or reorder messages, and a mode stripped or changed on the way gives different keys and fails
the first frame. A peer that fails the check is dropped and the run goes on.

Sessions: a rank's channel outlives its connections. Each frame's body starts with the message's
sequence number and its sender's acknowledgement (``sparktrain.seam.session``); a rank whose
connection breaks opens a new one, with a fresh handshake as above, and resumes its session there.
The frames of this module know nothing of that: :meth:`Channel.send_encoded` and
:meth:`Channel.recv_body` carry bodies, :meth:`Channel.send` and :meth:`Channel.recv` whole messages
(a ``sparktrain.tune`` trial's channel, which has no sessions).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import threading
from . import crypto, protocol
from ..errors import SparkTrainError

_MAGIC = b"SPKT2"
_CLEAR, _SEALED = b"C", b"E"
NONCE_BYTES = 16
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
    """One authenticated, framed connection, encrypted or not. ``send`` is thread-safe; ``recv``
    is for one reader. The driver's end (``is_server``) reads what a rank sends, a rank's end what
    the driver sends."""

    def __init__(self, sock: socket.socket, out_key: bytes, in_key: bytes, *, encrypted: bool, is_server: bool):
        self.sock = sock
        self.encrypted = encrypted
        self._out_key, self._in_key = out_key, in_key
        self._out = crypto.Aead(out_key) if encrypted else None
        self._in = crypto.Aead(in_key) if encrypted else None
        self._sender = protocol.RANK if is_server else protocol.DRIVER
        self._out_seq = 0
        self._in_seq = 0
        self._send_lock = threading.Lock()
        self.closed = False

    @staticmethod
    def _mac(key: bytes, seq: int, body: bytes) -> bytes:
        return hmac.new(key, seq.to_bytes(8, "big") + body, hashlib.sha256).digest()

    def send(self, msg: protocol.Message) -> None:
        self.send_encoded(protocol.encode(msg))

    def send_encoded(self, body: bytes) -> None:
        """Send a message already encoded (``protocol.encode``): one message to many channels is
        encoded once."""
        if len(body) > MAX_FRAME:
            raise ValueError(f"message of {len(body)} bytes exceeds the channel's {MAX_FRAME} byte frame limit")
        with self._send_lock:
            if self._out is not None:
                header = _HEADER.pack(len(body))
                frame = header + self._out.seal(header, body)
            else:
                frame = _HEADER.pack(len(body)) + self._mac(self._out_key, self._out_seq, body) + body
            self._out_seq += 1
            self.sock.sendall(frame)

    def recv(self) -> protocol.Message | None:
        """The next message, or None when the peer closed. Raises AuthenticationError on a bad MAC,
        ``protocol.ProtocolError`` on a signed message that is not one the peer may send."""
        body = self.recv_body()
        return None if body is None else protocol.decode(body, self._sender)

    def recv_body(self) -> bytes | None:
        """The next frame's body, checked, not parsed; None when the peer closed. Raises
        AuthenticationError on a bad MAC."""
        header = _recv_exact(self.sock, _HEADER.size)
        if header is None:
            return None
        rest = _recv_exact(self.sock, self._frame_rest(header))
        return None if rest is None else self._open(header, rest)

    def unframe(self, buf: bytearray) -> bytes | None:
        """The body of the next frame whole in ``buf``, checked and taken out of it, or None while
        it is incomplete: the receiving end of a channel read by an event loop, which appends what
        arrives to ``buf``. Raises AuthenticationError on a bad MAC."""
        if len(buf) < _HEADER.size:
            return None
        header = bytes(buf[:_HEADER.size])
        end = _HEADER.size + self._frame_rest(header)
        if len(buf) < end:
            return None
        rest = bytes(buf[_HEADER.size:end])
        del buf[:end]
        return self._open(header, rest)

    def decode(self, body: bytes) -> protocol.Message:
        """The message in a body :meth:`unframe` or :meth:`recv_body` returned, as the peer may send it."""
        return protocol.decode(body, self._sender)

    def _frame_rest(self, header: bytes) -> int:
        """How many bytes follow a frame's header; raises for a frame over the limit."""
        (length,) = _HEADER.unpack(header)
        if length > MAX_FRAME:
            raise AuthenticationError(f"frame of {length} bytes is over the {MAX_FRAME} byte limit")
        return length + (crypto.TAG_BYTES if self._in is not None else _MAC_BYTES)

    def _open(self, header: bytes, rest: bytes) -> bytes:
        """The body of one whole frame, checked before anything parses it."""
        if self._in is not None:
            try:  # opened before parsing: nothing unauthenticated reaches json (or anything else)
                body = self._in.open(header, rest)
            except crypto.AuthenticationFailed:
                raise AuthenticationError("message authentication failed") from None
        else:
            mac, body = rest[:_MAC_BYTES], rest[_MAC_BYTES:]
            # Verify before parsing: nothing from an unauthenticated peer reaches json (or anything else).
            if not hmac.compare_digest(mac, self._mac(self._in_key, self._in_seq, body)):
                raise AuthenticationError("message authentication failed")
        self._in_seq += 1
        return body

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _keys(secret: bytes, mode: bytes, nonce_s: bytes, nonce_c: bytes) -> tuple[bytes, bytes]:
    """The driver-to-rank and rank-to-driver keys (an AES-256 key and nonce base when encrypted)."""
    n = crypto.KEY_BYTES + crypto.IV_BYTES if mode == _SEALED else 32
    return tuple(crypto.hkdf_sha256(nonce_s + nonce_c, secret, b"sparktrain channel 2|" + mode + b"|" + d, n)
                 for d in (b"s>c", b"c>s"))  # type: ignore[return-value]


def connect(address: tuple[str, int], secret: bytes, timeout: float, encrypted: bool | None = None) -> Channel:
    """Open a channel to the driver (rank side). Raises OSError when it cannot be reached.
    ``encrypted``: what the run asked for (a driver that says otherwise is refused); None: as the
    driver says."""
    sock = socket.create_connection(address, timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        greeting = _recv_exact(sock, len(_MAGIC) + 1 + NONCE_BYTES)
        mode = greeting[len(_MAGIC):len(_MAGIC) + 1] if greeting else b""
        if greeting is None or not greeting.startswith(_MAGIC) or mode not in (_CLEAR, _SEALED):
            raise ConnectionError(f"{address[0]}:{address[1]} is not a sparktrain driver channel")
        if encrypted is not None and (mode == _SEALED) != encrypted:
            raise ConnectionError(f"the driver channel at {address[0]}:{address[1]} says it is "
                                  f"{'encrypted' if mode == _SEALED else 'in clear'}; this run asked otherwise")
        nonce_c = os.urandom(NONCE_BYTES)
        sock.sendall(nonce_c)
        sock.settimeout(None)
        to_rank, to_driver = _keys(secret, mode, greeting[len(_MAGIC) + 1:], nonce_c)
        return Channel(sock, to_driver, to_rank, encrypted=mode == _SEALED, is_server=False)
    except BaseException:
        sock.close()
        raise


def accept(sock: socket.socket, secret: bytes, encrypted: bool = False) -> Channel:
    """Open the driver's end of a new connection: greet it with a fresh nonce and the mode, read
    the rank's nonce (driver side)."""
    nonce = greet(sock, encrypted)
    sock.settimeout(AUTH_TIMEOUT)
    nonce_c = _recv_exact(sock, NONCE_BYTES)
    if nonce_c is None:
        raise AuthenticationError("the peer closed before it sent its nonce")
    return accepted(sock, secret, encrypted, nonce, nonce_c)


def greet(sock: socket.socket, encrypted: bool) -> bytes:
    """The driver's first words on a new connection: the magic, the mode and a fresh nonce, which
    it returns. The rank answers with :data:`NONCE_BYTES` bytes of its own (see :func:`accepted`)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    nonce = os.urandom(NONCE_BYTES)
    sock.sendall(_MAGIC + (_SEALED if encrypted else _CLEAR) + nonce)
    return nonce


def accepted(sock: socket.socket, secret: bytes, encrypted: bool, nonce: bytes, nonce_c: bytes) -> Channel:
    """The driver's end of a connection it greeted with ``nonce``, once the rank's ``nonce_c`` came."""
    to_rank, to_driver = _keys(secret, _SEALED if encrypted else _CLEAR, nonce, nonce_c)
    return Channel(sock, to_rank, to_driver, encrypted=encrypted, is_server=True)
