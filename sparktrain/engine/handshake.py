"""The ring's connections between hosts: each side proves it holds the run's key (HMAC-SHA256 over
fresh nonces from both ends, and whether the ring is encrypted) before the library sees the socket.

Where the ring is encrypted, each direction of each connection gets its own AES-256-GCM key and
nonce base (:func:`ring_keys`): HKDF-SHA256 (the engine's, over libcrypto) of the run's secret,
salted with both ends' nonces, with the run and attempt (``name``) and the direction (sender and
receiver ranks) as its info. No two connections or directions share a key, nor two attempts.
"""
from __future__ import annotations

import ctypes
import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time

from .loader import _ERRLEN, CollectiveError, _HELLO

#: What the handshake's MACs bind besides the nonces: the ring's protection, so that ends that
#: disagree (or a stripped flag) fail the handshake instead of reading records as data.
MODE_CLEAR, MODE_AEAD = b"clear", b"aes-256-gcm"
_KEY_IV = 44  # an AES-256 key and a 12-byte nonce base


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"|".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("connection closed during the handshake")
        data += chunk
    return data


def _hkdf(lib, salt: bytes, ikm: bytes, info: bytes, n: int) -> bytes:
    out = ctypes.create_string_buffer(n)
    err = ctypes.create_string_buffer(_ERRLEN)
    if lib.stc_hkdf_sha256(salt, len(salt), ikm, len(ikm), info, len(info), out, n, err, _ERRLEN) != 0:
        raise CollectiveError(err.value.decode(errors="replace"))
    return out.raw


def ring_keys(lib, secret: bytes, name: bytes, rank: int, nxt: int, prv: int, next_salt: bytes,
              prev_salt: bytes) -> bytes:
    """The four directions' key material of a leader's two connections, in the engine's order
    (``stc_config.ring_keys``): to the next leader, from it, from the previous one, to it."""
    def one(salt: bytes, sender: int, receiver: int) -> bytes:
        return _hkdf(lib, salt, secret, b"sparktrain ring 1|%s|%d>%d" % (name, sender, receiver), _KEY_IV)
    return (one(next_salt, rank, nxt) + one(next_salt, nxt, rank) + one(prev_salt, prv, rank) +
            one(prev_salt, rank, prv))


def _authenticate_client(sock: socket.socket, key: bytes, name: bytes, rank: int, mode: bytes) -> bytes:
    """Proves this end holds the key; returns the connection's salt (both ends' nonces)."""
    hello = _recv_exact(sock, len(_HELLO) + 32)
    if hello[:len(_HELLO)] != _HELLO:
        raise ConnectionError("the peer is not a sparktrain collective endpoint")
    nonce_s, nonce_c = hello[len(_HELLO):], secrets.token_bytes(32)
    r = struct.pack("!i", rank)
    sock.sendall(r + nonce_c + _mac(key, b"client", name, nonce_s, nonce_c, r, mode))
    if not hmac.compare_digest(_recv_exact(sock, 32), _mac(key, b"server", name, nonce_s, nonce_c, r, mode)):
        raise ConnectionError("the peer does not hold the run's secret, or does not agree on encryption")
    return nonce_s + nonce_c


def _authenticate_server(sock: socket.socket, key: bytes, name: bytes, expected_rank: int, mode: bytes) -> bytes:
    nonce_s = secrets.token_bytes(32)
    sock.sendall(_HELLO + nonce_s)
    reply = _recv_exact(sock, 4 + 32 + 32)
    r, nonce_c, mac = reply[:4], reply[4:36], reply[36:]
    if not hmac.compare_digest(mac, _mac(key, b"client", name, nonce_s, nonce_c, r, mode)):
        raise ConnectionError("refused a connection that does not hold the run's secret or does not agree on "
                              "encryption")
    if struct.unpack("!i", r)[0] != expected_rank:
        raise ConnectionError(f"rank {struct.unpack('!i', r)[0]} connected where rank {expected_rank} was expected")
    sock.sendall(_mac(key, b"server", name, nonce_s, nonce_c, r, mode))
    return nonce_s + nonce_c


def _connect_ring(listener: socket.socket, next_addr: tuple[str, int], key: bytes, name: bytes, rank: int,
                  next_rank: int, prev_rank: int, deadline: float, mode: bytes = MODE_CLEAR):
    """Connect to the next leader and accept the previous one, both authenticated: (next socket,
    previous socket, the next connection's salt, the previous one's)."""
    out: dict[str, object] = {}

    def dial():
        delay = 0.01
        while True:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.settimeout(max(0.1, deadline - time.monotonic()))
                s.connect(next_addr)
                out["salt"] = _authenticate_client(s, key, name, rank, mode)
                s.settimeout(None)
                out["next"] = s
                return
            except (OSError, ConnectionError) as e:
                s.close()
                if time.monotonic() + delay > deadline:
                    out["error"] = f"rank {rank} could not connect to rank {next_rank} at {next_addr[0]}:{next_addr[1]}: {e}"
                    return
                time.sleep(delay)  # the peer is not listening yet: nothing to wait on but time
                delay = min(delay * 2, 0.5)

    dialer = threading.Thread(target=dial, name="sparktrain-ring-dial", daemon=True)
    dialer.start()
    prev = None
    try:
        while prev is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CollectiveError(f"rank {rank} waited for rank {prev_rank} to connect until the collective "
                                      f"timeout passed")
            listener.settimeout(left)
            try:
                s, _ = listener.accept()
            except socket.timeout:
                continue
            s.settimeout(min(5.0, max(0.1, deadline - time.monotonic())))  # a silent stranger cannot stall us long
            try:
                prev_salt = _authenticate_server(s, key, name, prev_rank, mode)
                s.settimeout(None)
                prev = s
            except (OSError, ConnectionError):
                s.close()
        dialer.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if "next" not in out:
            raise CollectiveError(str(out.get("error", f"rank {rank} timed out connecting to rank {next_rank}")))
        return out["next"], prev, out["salt"], prev_salt
    except BaseException:
        if prev is not None:
            prev.close()
        dialer.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if isinstance(out.get("next"), socket.socket):
            out["next"].close()  # type: ignore[union-attr]
        raise


