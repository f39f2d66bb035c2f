"""The ring's connections between hosts: each side proves it holds the run's key (HMAC-SHA256 over
a fresh challenge) before the library sees the socket."""
from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time

from .loader import CollectiveError, _HELLO


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


def _authenticate_client(sock: socket.socket, key: bytes, name: bytes, rank: int) -> None:
    hello = _recv_exact(sock, len(_HELLO) + 32)
    if hello[:len(_HELLO)] != _HELLO:
        raise ConnectionError("the peer is not a sparktrain collective endpoint")
    nonce_s, nonce_c = hello[len(_HELLO):], secrets.token_bytes(32)
    r = struct.pack("!i", rank)
    sock.sendall(r + nonce_c + _mac(key, b"client", name, nonce_s, nonce_c, r))
    if not hmac.compare_digest(_recv_exact(sock, 32), _mac(key, b"server", name, nonce_s, nonce_c, r)):
        raise ConnectionError("the peer does not hold the run's secret")


def _authenticate_server(sock: socket.socket, key: bytes, name: bytes, expected_rank: int) -> None:
    nonce_s = secrets.token_bytes(32)
    sock.sendall(_HELLO + nonce_s)
    reply = _recv_exact(sock, 4 + 32 + 32)
    r, nonce_c, mac = reply[:4], reply[4:36], reply[36:]
    if not hmac.compare_digest(mac, _mac(key, b"client", name, nonce_s, nonce_c, r)):
        raise ConnectionError("refused a connection that does not hold the run's secret")
    if struct.unpack("!i", r)[0] != expected_rank:
        raise ConnectionError(f"rank {struct.unpack('!i', r)[0]} connected where rank {expected_rank} was expected")
    sock.sendall(_mac(key, b"server", name, nonce_s, nonce_c, r))


def _connect_ring(listener: socket.socket, next_addr: tuple[str, int], key: bytes, name: bytes, rank: int,
                  next_rank: int, prev_rank: int, deadline: float) -> tuple[socket.socket, socket.socket]:
    """Connect to the next leader and accept the previous one, both authenticated."""
    out: dict[str, object] = {}

    def dial():
        delay = 0.01
        while True:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.settimeout(max(0.1, deadline - time.monotonic()))
                s.connect(next_addr)
                _authenticate_client(s, key, name, rank)
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
                _authenticate_server(s, key, name, prev_rank)
                s.settimeout(None)
                prev = s
            except (OSError, ConnectionError):
                s.close()
        dialer.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if "next" not in out:
            raise CollectiveError(str(out.get("error", f"rank {rank} timed out connecting to rank {next_rank}")))
        return out["next"], prev  # type: ignore[return-value]
    except BaseException:
        if prev is not None:
            prev.close()
        dialer.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if isinstance(out.get("next"), socket.socket):
            out["next"].close()  # type: ignore[union-attr]
        raise


