/* The ring's cryptography: OpenSSL's libcrypto, loaded at run time (libcrypto.so.3, else
 * libcrypto.so.1.1), so that the build needs no headers and the install no package. Only the
 * few EVP and HMAC calls below are used, through prototypes declared here; no cipher is written
 * here. Where no libcrypto loads, encryption is unavailable and says why (stc_crypto_available).
 *
 * What is built on them:
 *   - HKDF-SHA256 (RFC 5869): extract and expand, over libcrypto's HMAC;
 *   - AES-256-GCM seal and open of one buffer (96-bit nonce, 128-bit tag);
 *   - the ring's records (link.c): a direction's key and nonce base from HKDF, a record's nonce
 *     the base XOR its sequence number, which is also in the authenticated data with the record's
 *     length, so a replayed, reordered, cut or altered record fails its tag.
 * stc_hkdf_sha256, stc_aead_seal and stc_aead_open are exported for known-answer tests and for
 * the caller's key derivation.
 */
#define _GNU_SOURCE
#include "engine.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CTRL_GCM_GET_TAG 0x10 /* EVP_CTRL_GCM_GET_TAG / EVP_CTRL_AEAD_GET_TAG */
#define CTRL_GCM_SET_TAG 0x11 /* EVP_CTRL_GCM_SET_TAG / EVP_CTRL_AEAD_SET_TAG */

typedef void *(*ctx_new_fn)(void);
typedef void (*ctx_free_fn)(void *);
typedef const void *(*cipher_fn)(void);
typedef int (*init_fn)(void *, const void *, void *, const unsigned char *, const unsigned char *);
typedef int (*update_fn)(void *, unsigned char *, int *, const unsigned char *, int);
typedef int (*final_fn)(void *, unsigned char *, int *);
typedef int (*ctrl_fn)(void *, int, int, void *);
typedef const void *(*md_fn)(void);
typedef unsigned char *(*hmac_fn)(const void *, const void *, int, const unsigned char *, size_t, unsigned char *,
                                  unsigned int *);

static struct {
    pthread_once_t once;
    void *handle;
    char name[32];
    char why[256];
    ctx_new_fn ctx_new;
    ctx_free_fn ctx_free;
    cipher_fn aes_256_gcm;
    init_fn enc_init, dec_init;
    update_fn enc_update, dec_update;
    final_fn enc_final, dec_final;
    ctrl_fn ctrl;
    md_fn sha256;
    hmac_fn hmac;
} L = {PTHREAD_ONCE_INIT};

static void load(void) {
    static const char *names[] = {"libcrypto.so.3", "libcrypto.so.1.1"};
    char tried[64] = ""; /* the names below, with separators: short enough for L.why with its words */
    for (size_t i = 0; i < sizeof names / sizeof *names && !L.handle; i++) {
        L.handle = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (L.handle) snprintf(L.name, sizeof L.name, "%s", names[i]);
        else snprintf(tried + strlen(tried), sizeof tried - strlen(tried), "%s%s", i ? ", " : "", names[i]);
    }
    if (!L.handle) {
        snprintf(L.why, sizeof L.why, "no OpenSSL libcrypto could be loaded (tried %s); install OpenSSL 3 or 1.1 "
                 "(libcrypto) on every host", tried);
        return;
    }
#define SYM(field, type, sym)                                                                                    \
    do {                                                                                                         \
        *(void **)&L.field = dlsym(L.handle, sym);                                                               \
        if (!L.field) {                                                                                          \
            snprintf(L.why, sizeof L.why, "%s has no %s", L.name, sym);                                          \
            return;                                                                                              \
        }                                                                                                        \
    } while (0)
    SYM(ctx_new, ctx_new_fn, "EVP_CIPHER_CTX_new");
    SYM(ctx_free, ctx_free_fn, "EVP_CIPHER_CTX_free");
    SYM(aes_256_gcm, cipher_fn, "EVP_aes_256_gcm");
    SYM(enc_init, init_fn, "EVP_EncryptInit_ex");
    SYM(dec_init, init_fn, "EVP_DecryptInit_ex");
    SYM(enc_update, update_fn, "EVP_EncryptUpdate");
    SYM(dec_update, update_fn, "EVP_DecryptUpdate");
    SYM(enc_final, final_fn, "EVP_EncryptFinal_ex");
    SYM(dec_final, final_fn, "EVP_DecryptFinal_ex");
    SYM(ctrl, ctrl_fn, "EVP_CIPHER_CTX_ctrl");
    SYM(sha256, md_fn, "EVP_sha256");
    SYM(hmac, hmac_fn, "HMAC");
#undef SYM
}

int crypto_ready(char *err, size_t errlen) {
    pthread_once(&L.once, load);
    if (L.why[0]) return fail(err, errlen, STC_E_SYS, "encryption is unavailable: %s", L.why);
    return STC_OK;
}

int stc_crypto_available(char *name, size_t namelen) {
    int rc = crypto_ready(name, namelen);
    if (!rc && name && namelen) snprintf(name, namelen, "%s", L.name);
    return rc;
}

int stc_hkdf_sha256(const uint8_t *salt, size_t saltlen, const uint8_t *ikm, size_t ikmlen, const uint8_t *info,
                    size_t infolen, uint8_t *out, size_t outlen, char *err, size_t errlen) {
    int rc = crypto_ready(err, errlen);
    if (rc) return rc;
    if (outlen > 255 * 32 || infolen > 1024) return fail(err, errlen, STC_E_ARG, "hkdf: output or info too long");
    static const uint8_t zeros[32];
    uint8_t prk[32], t[32 + 1024 + 1];
    unsigned int n = 0;
    if (!L.hmac(L.sha256(), saltlen ? salt : zeros, saltlen ? (int)saltlen : 32, ikm, ikmlen, prk, &n) || n != 32)
        return fail(err, errlen, STC_E_SYS, "hkdf: HMAC failed");
    size_t done = 0, tlen = 0;
    for (uint8_t i = 1; done < outlen; i++) { /* T(i) = HMAC(PRK, T(i-1) | info | i) */
        memcpy(t + tlen, info, infolen);
        t[tlen + infolen] = i;
        uint8_t block[32];
        if (!L.hmac(L.sha256(), prk, 32, t, tlen + infolen + 1, block, &n) || n != 32)
            return fail(err, errlen, STC_E_SYS, "hkdf: HMAC failed");
        size_t take = outlen - done < 32 ? outlen - done : 32;
        memcpy(out + done, block, take);
        memcpy(t, block, 32);
        tlen = 32;
        done += take;
    }
    memset(prk, 0, sizeof prk);
    return STC_OK;
}

/* One AES-256-GCM operation on a context whose key is set: seal (enc) or open in to out. */
static int gcm_run(void *ctx, int enc, const uint8_t *iv, const uint8_t *aad, size_t aadlen, const uint8_t *in,
                   size_t len, uint8_t *out, uint8_t *tag) {
    int outl = 0;
    if (enc) {
        if (L.enc_init(ctx, NULL, NULL, NULL, iv) != 1) return -1;
        if (aadlen && L.enc_update(ctx, NULL, &outl, aad, (int)aadlen) != 1) return -1;
        if (len && L.enc_update(ctx, out, &outl, in, (int)len) != 1) return -1;
        if (L.enc_final(ctx, out + outl, &outl) != 1) return -1;
        return L.ctrl(ctx, CTRL_GCM_GET_TAG, AEAD_TAG, tag) == 1 ? 0 : -1;
    }
    if (L.dec_init(ctx, NULL, NULL, NULL, iv) != 1) return -1;
    if (aadlen && L.dec_update(ctx, NULL, &outl, aad, (int)aadlen) != 1) return -1;
    if (len && L.dec_update(ctx, out, &outl, in, (int)len) != 1) return -1;
    if (L.ctrl(ctx, CTRL_GCM_SET_TAG, AEAD_TAG, tag) != 1) return -1;
    return L.dec_final(ctx, out + outl, &outl) == 1 ? 0 : -2;
}

static void *gcm_new(int enc, const uint8_t *key) {
    void *ctx = L.ctx_new();
    if (!ctx) return NULL;
    init_fn init = enc ? L.enc_init : L.dec_init;
    if (init(ctx, L.aes_256_gcm(), NULL, key, NULL) != 1) {
        L.ctx_free(ctx);
        return NULL;
    }
    return ctx;
}

static int aead_once(int enc, const uint8_t *key, const uint8_t *iv, size_t ivlen, const uint8_t *aad, size_t aadlen,
                     const uint8_t *in, size_t len, uint8_t *out, uint8_t *tag, char *err, size_t errlen) {
    int rc = crypto_ready(err, errlen);
    if (rc) return rc;
    if (ivlen != AEAD_IV || len > (1u << 30)) return fail(err, errlen, STC_E_ARG, "aead: a 12-byte nonce, up to 1 GiB");
    void *ctx = gcm_new(enc, key);
    if (!ctx) return fail(err, errlen, STC_E_SYS, "aead: could not set up AES-256-GCM");
    int r = gcm_run(ctx, enc, iv, aad, aadlen, in, len, out, tag);
    L.ctx_free(ctx);
    if (r == -2) return fail(err, errlen, STC_E_PEER, "aead: authentication failed");
    return r ? fail(err, errlen, STC_E_SYS, "aead: AES-256-GCM failed") : STC_OK;
}

int stc_aead_seal(const uint8_t *key, const uint8_t *iv, size_t ivlen, const uint8_t *aad, size_t aadlen,
                  const uint8_t *in, size_t len, uint8_t *out, uint8_t *tag, char *err, size_t errlen) {
    return aead_once(1, key, iv, ivlen, aad, aadlen, in, len, out, tag, err, errlen);
}

int stc_aead_open(const uint8_t *key, const uint8_t *iv, size_t ivlen, const uint8_t *aad, size_t aadlen,
                  const uint8_t *in, size_t len, uint8_t *out, const uint8_t *tag, char *err, size_t errlen) {
    return aead_once(0, key, iv, ivlen, aad, aadlen, in, len, out, (uint8_t *)tag, err, errlen);
}

/* -- a direction of a ring connection ---------------------------------------------------------- */

int aead_dir_init(aead_dir *d, int enc, const uint8_t *key_iv, char *err, size_t errlen) {
    int rc = crypto_ready(err, errlen);
    if (rc) return rc;
    d->ctx = gcm_new(enc, key_iv);
    if (!d->ctx) return fail(err, errlen, STC_E_SYS, "could not set up AES-256-GCM");
    memcpy(d->iv, key_iv + AEAD_KEY, AEAD_IV);
    d->seq = 0;
    d->enc = enc;
    return STC_OK;
}

void aead_dir_free(aead_dir *d) {
    if (d->ctx) L.ctx_free(d->ctx);
    d->ctx = NULL;
}

/* The record's nonce and authenticated data: its sequence number and length. */
static void record_params(const aead_dir *d, uint32_t len, uint8_t iv[AEAD_IV], uint8_t aad[12]) {
    memcpy(iv, d->iv, AEAD_IV);
    for (int i = 0; i < 8; i++) {
        uint8_t b = (uint8_t)(d->seq >> (56 - 8 * i));
        iv[4 + i] ^= b;
        aad[i] = b;
    }
    for (int i = 0; i < 4; i++) aad[8 + i] = (uint8_t)(len >> (24 - 8 * i));
}

/* Seals len bytes of in as the direction's next record at out: a 4-byte length, the ciphertext,
 * the tag (REC_OVERHEAD + len bytes). 0, or -1 when libcrypto failed. */
int aead_seal_record(aead_dir *d, const char *in, uint32_t len, char *out) {
    uint8_t iv[AEAD_IV], aad[12];
    record_params(d, len, iv, aad);
    memcpy(out, aad + 8, 4);
    if (gcm_run(d->ctx, 1, iv, aad, sizeof aad, (const uint8_t *)in, len, (uint8_t *)out + 4,
                (uint8_t *)out + 4 + len))
        return -1;
    d->seq++;
    return 0;
}

/* The length a record's header announces. */
uint32_t aead_record_len(const char *hdr) {
    const uint8_t *h = (const uint8_t *)hdr;
    return (uint32_t)h[0] << 24 | (uint32_t)h[1] << 16 | (uint32_t)h[2] << 8 | h[3];
}

/* Opens the whole record at rec (header, ciphertext, tag) into out. 0; -2: it fails its tag
 * (altered, replayed, reordered, or sealed with another key); -1: libcrypto failed. */
int aead_open_record(aead_dir *d, const char *rec, char *out) {
    uint32_t len = aead_record_len(rec);
    uint8_t iv[AEAD_IV], aad[12];
    record_params(d, len, iv, aad);
    int r = gcm_run(d->ctx, 0, iv, aad, sizeof aad, (const uint8_t *)rec + 4, len, (uint8_t *)out,
                    (uint8_t *)rec + 4 + len);
    if (!r) d->seq++;
    return r;
}
