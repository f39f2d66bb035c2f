"""The encrypted ring: the engine's cryptography against published vectors, the ring's results in
AES-256-GCM records equal to the clear ring's, and records altered or replayed on the wire.

Plain forked ranks (tests/native_ranks.py), no Spark. Ranks on 127.0.0.1, .2 and .3 are three
hosts to the engine.
"""
from __future__ import annotations

import ctypes
import socket
import struct
import threading

import pytest

from sparktrain.seam import crypto
from sparktrain import engine
from sparktrain.engine.loader import _ERRLEN

import native_ranks as nr

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not engine.available(), reason=str(engine.unavailable_reason())),
              pytest.mark.skipif(engine.available() and engine.crypto_unavailable() is not None,
                                 reason=str(engine.available() and engine.crypto_unavailable()))]

h = bytes.fromhex

# RFC 5869, appendix A: test cases 1 and 3 (SHA-256).
HKDF_VECTORS = [
    (h("000102030405060708090a0b0c"), b"\x0b" * 22, h("f0f1f2f3f4f5f6f7f8f9"),
     h("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865")),
    (b"", b"\x0b" * 22, b"",
     h("8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d9d201395faa4b61a96c8")),
]
# The GCM specification's AES-256 test cases 13 to 16 (McGrew and Viega; NIST SP 800-38D's vectors).
_K15, _IV15 = h("feffe9928665731c6d6a8f9467308308feffe9928665731c6d6a8f9467308308"), h("cafebabefacedbaddecaf888")
_P15 = h("d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a721c3c0c95956809532fcf0e2449a6b525b1"
         "6aedf5aa0de657ba637b391aafd255")
_C15 = h("522dc1f099567d07f47f37a32a84427d643a8cdcbfe5c0c97598a2bd2555d1aa8cb08e48590dbb3da7b08b1056828838c5f6"
         "1e6393ba7a0abcc9f662898015ad")
GCM_VECTORS = [  # key, iv, aad, plaintext, ciphertext, tag
    (bytes(32), bytes(12), b"", b"", b"", h("530f8afbc74536b9a963b4f1c4cb738b")),
    (bytes(32), bytes(12), b"", bytes(16), h("cea7403d4d606b6e074ec5d3baf39d18"), h("d0d1c8a799996bf0265b98b5d48ab919")),
    (_K15, _IV15, b"", _P15, _C15, h("b094dac5d93471bdec1a502270e3cc6c")),
    (_K15, _IV15, h("feedfacedeadbeeffeedfacedeadbeefabaddad2"), _P15[:60], _C15[:60],
     h("76fc6ece0f4e1768cddf8853bb2d551b")),
]

THREE_HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
TWO_HOSTS_OF_TWO = ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"]


def _seal(lib, key, iv, aad, pt):
    out, tag, err = ctypes.create_string_buffer(max(1, len(pt))), ctypes.create_string_buffer(16), \
        ctypes.create_string_buffer(_ERRLEN)
    assert lib.stc_aead_seal(key, iv, len(iv), aad, len(aad), pt, len(pt), out, tag, err, _ERRLEN) == 0, err.value
    return out.raw[:len(pt)], tag.raw


def _open(lib, key, iv, aad, ct, tag):
    out, err = ctypes.create_string_buffer(max(1, len(ct))), ctypes.create_string_buffer(_ERRLEN)
    rc = lib.stc_aead_open(key, iv, len(iv), aad, len(aad), ct, len(ct), out, tag, err, _ERRLEN)
    return (out.raw[:len(ct)] if rc == 0 else None), rc


def test_hkdf_and_aes_gcm_give_the_published_answers_and_open_refuses_any_change():
    """The engine's (native/crypto.c) and the channel's (sparktrain.seam.crypto)."""
    assert crypto.unavailable() is None
    for salt, ikm, info, okm in HKDF_VECTORS:
        assert crypto.hkdf_sha256(salt, ikm, info, len(okm)) == okm
    for key, iv, aad, pt, ct, tag in GCM_VECTORS:
        assert crypto.gcm_seal(key, iv, aad, pt) == ct + tag and crypto.gcm_open(key, iv, aad, ct + tag) == pt
        for bad in ((key, iv, aad + b"x", ct + tag), (key, iv, aad, ct + bytes([tag[0] ^ 1]) + tag[1:])):
            with pytest.raises(crypto.AuthenticationFailed):
                crypto.gcm_open(*bad)
    lib = engine.library()
    name = ctypes.create_string_buffer(64)
    assert lib.stc_crypto_available(name, 64) == 0 and name.value.startswith(b"libcrypto.so.")
    for salt, ikm, info, okm in HKDF_VECTORS:
        out, err = ctypes.create_string_buffer(len(okm)), ctypes.create_string_buffer(_ERRLEN)
        assert lib.stc_hkdf_sha256(salt, len(salt), ikm, len(ikm), info, len(info), out, len(okm), err, _ERRLEN) == 0
        assert out.raw == okm
    for key, iv, aad, pt, ct, tag in GCM_VECTORS:
        assert _seal(lib, key, iv, aad, pt) == (ct, tag)
        assert _open(lib, key, iv, aad, ct, tag) == (pt, 0)
        flipped_key = bytes([key[0] ^ 1]) + key[1:]
        changes = [(flipped_key, iv, aad, ct, tag), (key, bytes([iv[0] ^ 1]) + iv[1:], aad, ct, tag),
                   (key, iv, aad + b"x", ct, tag), (key, iv, aad, ct, bytes([tag[0] ^ 0x80]) + tag[1:])]
        if ct:
            changes.append((key, iv, aad, bytes([ct[0] ^ 1]) + ct[1:], tag))
        for change in changes:
            assert _open(lib, *change) == (None, engine.PEER)


def _traffic_and_results(comm):
    """Every collective over 3 hosts; the pipelined allreduce (the ring on a thread of its own) over
    2 hosts of 2."""
    sent, received = ctypes.c_uint64(), ctypes.c_uint64()
    three = comm.size == 3
    out = {"correct": nr.correctness(comm, (1, 1000, 300_001), dtypes=("float32", "int64")) if three else
           {"bad": []}, "other": nr.other_ops(comm) if three else None,
           "pipelined": None if three else nr.pipelined(comm, cases=(("float32", "sum"), ("int32", "average")),
                                                              randoms=("float32",)), "encrypted": comm.encrypted}
    comm._lib.stc_comm_traffic(comm._handle, ctypes.byref(sent), ctypes.byref(received))
    out["traffic"] = (sent.value, received.value)
    return out


@pytest.mark.parametrize("n, hosts", [(3, THREE_HOSTS), (4, TWO_HOSTS_OF_TWO)], ids=["3hosts", "2hosts-of-2"])
def test_the_encrypted_ring_gives_the_clear_rings_results_bit_for_bit(n, hosts):
    sealed = nr.all_ok(nr.run_ranks(n, _traffic_and_results, hosts=hosts, encrypt=True), n)
    if n == 4:  # checked against numpy, in the engine's order of reduction
        assert all(sealed[r]["encrypted"] and not sealed[r]["pipelined"]["bad"] for r in range(n)), sealed
        return
    clear = nr.all_ok(nr.run_ranks(n, _traffic_and_results, hosts=hosts), n)
    for r in range(n):
        assert sealed[r]["encrypted"] and not clear[r]["encrypted"]
        assert not sealed[r]["correct"]["bad"], sealed[r]["correct"]["bad"]
        for part in ("correct", "other", "pipelined"):
            assert sealed[r][part] == clear[r][part], (r, part)
        # The same plaintext bytes crossed each link (the counts are the stream's, not the wire's).
        assert sealed[r]["traffic"] == clear[r]["traffic"]
    assert sealed[0]["traffic"][0] > 0


class _Proxy:
    """Between rank 0 and rank 1 (its next host's leader): passes the handshake and every record on,
    but alters one record (``flip``), sends one twice (``replay``) or swaps two (``reorder``)."""

    def __init__(self, how: str, victim: int = 3):
        self.how, self.victim = how, victim
        self.listener = socket.create_server(("127.0.0.2", 0))  # where rank 0 dials rank 1
        self.port = self.listener.getsockname()[1]
        self.done = threading.Event()

    def start(self, target_port: int) -> None:
        threading.Thread(target=self._run, args=(target_port,), daemon=True).start()

    def _run(self, target_port: int) -> None:
        self.listener.settimeout(60)
        a, _ = self.listener.accept()
        b = socket.create_connection(("127.0.0.2", target_port), timeout=60)
        threading.Thread(target=self._pipe, args=(b, a), daemon=True).start()  # backward: as it is
        try:
            self._forward(a, b)
        except OSError:
            pass
        finally:
            self.done.set()

    @staticmethod
    def _pipe(src, dst) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        for s in (src, dst):
            s.close()

    @staticmethod
    def _exact(sock, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise OSError("closed")
            data += chunk
        return data

    def _forward(self, a, b) -> None:
        b.sendall(self._exact(a, 4 + 32 + 32))  # the handshake's client half: rank, nonce, MAC
        k, held = 0, None
        while True:
            head = self._exact(a, 4)
            rec = head + self._exact(a, struct.unpack("!I", head)[0] + 16)
            if k == self.victim and self.how == "flip":
                rec = rec[:10] + bytes([rec[10] ^ 0x01]) + rec[11:]
            if k == self.victim and self.how == "reorder":
                held, k = rec, k + 1
                continue
            b.sendall(rec)
            if held is not None:
                b.sendall(held)
                held = None
            if k == self.victim and self.how == "replay":
                b.sendall(rec)
            k += 1


def _allreduce_until_it_fails(comm):
    import numpy as np

    for _ in range(50):
        try:
            comm.allreduce(np.ones(1 << 18, np.float32), "sum")
        except engine.CollectiveError as e:
            return {"code": e.code, "msg": str(e)}
    return {"code": 0, "msg": "no failure"}


@pytest.mark.parametrize("how, hosts", [("flip", THREE_HOSTS), ("replay", THREE_HOSTS), ("reorder", THREE_HOSTS),
                                       ("flip", TWO_HOSTS_OF_TWO)], ids=["flip", "replay", "reorder", "flip-2x2"])
def test_a_record_altered_replayed_or_reordered_on_the_wire_fails_every_rank_naming_the_link(how, hosts):
    n, nxt = len(hosts), hosts.index("127.0.0.2")  # rank 0's next leader, reached through the proxy
    proxy = _Proxy(how)
    leader = socket.create_server(("127.0.0.2", 0))  # listening before anyone dials: the proxy connects at once
    proxy.start(leader.getsockname()[1])
    results = nr.run_ranks(n, _allreduce_until_it_fails, hosts=hosts, encrypt=True, timeout=30,
                           dial={0: {nxt: proxy.port}}, listeners={nxt: leader})
    leader.close()
    got = nr.all_ok(results, n)
    for r in range(n):  # leaders and the ranks that share their hosts alike
        assert got[r]["code"] == engine.PEER, (r, got[r])
        msg = got[r]["msg"]
        assert "failed authentication" in msg and "127.0.0.1" in msg and "127.0.0.2" in msg, (r, msg)
    assert f"on the ring link from 127.0.0.1 (rank 0) to 127.0.0.2 (rank {nxt}) failed" in got[nxt]["msg"], got
    proxy.listener.close()
