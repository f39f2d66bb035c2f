"""HKDF-SHA256 and AES-256-GCM for the driver's channel. Pure and shared: the driver and the ranks.

The cipher is OpenSSL's libcrypto (``libcrypto.so.3``, else ``libcrypto.so.1.1``) through
ctypes: the library the native engine's ring loads too (``native/crypto.c``), and the one
Python's own ``ssl`` and ``hashlib`` are built on, so it is already on every host that runs
Python and needs no package. Where none loads, :func:`unavailable` says why, and a run that
asks for encryption fails before it launches. HKDF (RFC 5869) is two HMACs, taken from the
standard library's ``hmac``; no cipher is written here.
"""
from __future__ import annotations

import ctypes
import hashlib
import hmac
import threading

from ..errors import SparkTrainError

KEY_BYTES, IV_BYTES, TAG_BYTES = 32, 12, 16
_LIBS = ("libcrypto.so.3", "libcrypto.so.1.1")
_CTRL_GCM_GET_TAG, _CTRL_GCM_SET_TAG = 0x10, 0x11

_lib = None
_why: str | None = None
_lock = threading.Lock()


class AuthenticationFailed(SparkTrainError):
    """A sealed message that does not open: altered, replayed, reordered, or under another key."""


def _load():
    global _lib, _why
    with _lock:
        if _lib is not None or _why is not None:
            return _lib
        for name in _LIBS:
            try:
                lib = ctypes.CDLL(name)
            except OSError:
                continue
            vp, cp, ip = ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)
            try:
                lib.EVP_CIPHER_CTX_new.restype = vp
                lib.EVP_CIPHER_CTX_new.argtypes = []
                lib.EVP_CIPHER_CTX_free.argtypes = [vp]
                lib.EVP_CIPHER_CTX_free.restype = None
                lib.EVP_aes_256_gcm.restype = vp
                lib.EVP_aes_256_gcm.argtypes = []
                for fn in (lib.EVP_EncryptInit_ex, lib.EVP_DecryptInit_ex):
                    fn.argtypes = [vp, vp, vp, cp, cp]
                for fn in (lib.EVP_EncryptUpdate, lib.EVP_DecryptUpdate):
                    fn.argtypes = [vp, vp, ip, cp, ctypes.c_int]
                for fn in (lib.EVP_EncryptFinal_ex, lib.EVP_DecryptFinal_ex):
                    fn.argtypes = [vp, vp, ip]
                lib.EVP_CIPHER_CTX_ctrl.argtypes = [vp, ctypes.c_int, ctypes.c_int, vp]
            except AttributeError as e:
                _why = f"{name} lacks {e}"
                return None
            _lib = lib
            return _lib
        _why = f"no OpenSSL libcrypto could be loaded (tried {', '.join(_LIBS)}); install OpenSSL 3 or 1.1"
        return None


def unavailable() -> str | None:
    """Why this process cannot encrypt, or None when it can."""
    _load()
    return _why


def hkdf_sha256(salt: bytes, ikm: bytes, info: bytes, length: int) -> bytes:
    """RFC 5869's HKDF with SHA-256: ``length`` bytes of key material."""
    prk = hmac.new(salt or bytes(32), ikm, hashlib.sha256).digest()
    out, block, i = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out += block
        i += 1
    return out[:length]


def _gcm(seal: bool, key: bytes, iv: bytes, aad: bytes, data: bytes, tag: bytes = b"") -> bytes:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"encryption is unavailable: {_why}")
    if len(key) != KEY_BYTES or len(iv) != IV_BYTES:
        raise ValueError("AES-256-GCM takes a 32-byte key and a 12-byte nonce")
    n = ctypes.c_int()
    out, tag_buf = ctypes.create_string_buffer(len(data) + 16), ctypes.create_string_buffer(tag, TAG_BYTES)
    ctx = lib.EVP_CIPHER_CTX_new()
    if not ctx:
        raise MemoryError("EVP_CIPHER_CTX_new")
    try:
        init, update, final = ((lib.EVP_EncryptInit_ex, lib.EVP_EncryptUpdate, lib.EVP_EncryptFinal_ex) if seal else
                               (lib.EVP_DecryptInit_ex, lib.EVP_DecryptUpdate, lib.EVP_DecryptFinal_ex))
        ok = (init(ctx, lib.EVP_aes_256_gcm(), None, key, iv) == 1 and
              (not aad or update(ctx, None, ctypes.byref(n), aad, len(aad)) == 1) and
              (not data or update(ctx, out, ctypes.byref(n), data, len(data)) == 1))
        if ok and not seal:
            ok = lib.EVP_CIPHER_CTX_ctrl(ctx, _CTRL_GCM_SET_TAG, TAG_BYTES, tag_buf) == 1
        ok = ok and final(ctx, ctypes.byref(out, len(data)), ctypes.byref(n)) == 1
        if ok and seal:
            ok = lib.EVP_CIPHER_CTX_ctrl(ctx, _CTRL_GCM_GET_TAG, TAG_BYTES, tag_buf) == 1
    finally:
        lib.EVP_CIPHER_CTX_free(ctx)
    if not ok:
        if seal:
            raise RuntimeError("AES-256-GCM failed")
        raise AuthenticationFailed("message authentication failed")
    return out.raw[:len(data)] + (tag_buf.raw if seal else b"")


def gcm_seal(key: bytes, iv: bytes, aad: bytes, data: bytes) -> bytes:
    """AES-256-GCM: ``data`` encrypted, then its 16-byte tag over ``aad`` and the ciphertext."""
    return _gcm(True, key, iv, aad, data)


def gcm_open(key: bytes, iv: bytes, aad: bytes, sealed: bytes) -> bytes:
    """The data of :func:`gcm_seal`'s output; :class:`AuthenticationFailed` where it does not check out."""
    if len(sealed) < TAG_BYTES:
        raise AuthenticationFailed("message authentication failed")
    return _gcm(False, key, iv, aad, sealed[:-TAG_BYTES], sealed[-TAG_BYTES:])


class Aead:
    """One direction of a connection: AES-256-GCM under one key, message n sealed with the nonce
    base XOR n and with n in its authenticated data, so that each message opens only in its place."""

    def __init__(self, key_iv: bytes):
        self._key = key_iv[:KEY_BYTES]
        self._iv = int.from_bytes(key_iv[KEY_BYTES:KEY_BYTES + IV_BYTES], "big")
        self.seq = 0

    def _nonce_aad(self, header: bytes) -> tuple[bytes, bytes]:
        return (self._iv ^ self.seq).to_bytes(IV_BYTES, "big"), self.seq.to_bytes(8, "big") + header

    def seal(self, header: bytes, data: bytes) -> bytes:
        """The next message: ``data`` encrypted, then its tag; ``header`` is authenticated too."""
        sealed = gcm_seal(self._key, *self._nonce_aad(header), data)
        self.seq += 1
        return sealed

    def open(self, header: bytes, sealed: bytes) -> bytes:
        """The next message's data; :class:`AuthenticationFailed` where it does not check out."""
        data = gcm_open(self._key, *self._nonce_aad(header), sealed)
        self.seq += 1
        return data
