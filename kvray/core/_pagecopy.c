/* A page's xxh3-64 computed in the same pass as its copy, over the page's runs.
 *
 * Stored pages carry the xxh3-64 of their bytes and reads check it (kvray.core.pages,
 * kvray.core.tiers.disk). Copying a page and hashing it after reads every byte twice: on a
 * page-cache read the hash was a third of the time (the `disk_tier_vs_raw_file` rows).
 * copy_hash() copies from a contiguous source (a mapped disk slot) into the page's runs:
 * each 64-byte stripe is stored to its run as it is loaded for the hash (a 16 KiB block
 * that straddles two runs is hashed, then copied while still in L1), so memory is read
 * once. hash_runs() hashes runs without copying. Both release the GIL.
 *
 * The hash is XXH3-64 with seed 0 (the default secret) for inputs longer than 240 bytes,
 * computed as its specification defines it: the values are exactly those of xxhash.xxh3_64
 * (the disk format's checksum, docs/design.md), so pages stored before this module existed verify
 * (tests/core/test_pagecopy.py checks arbitrary bytes and run layouts against xxhash).
 * Shorter inputs return None and the caller hashes them with xxhash: no page is that small
 * in practice, and the short-input variants of XXH3 would be code without a use.
 *
 * A mapped source can lose its bytes under the copy (the file truncated by someone else):
 * the access raises SIGBUS, which copy_hash catches for its own thread and address range
 * and reports as None (the page is torn), passing any other SIGBUS to the previous handler.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#endif

#define STRIPE 64
#define SECRET_SIZE 192
#define STRIPES_PER_BLOCK ((SECRET_SIZE - STRIPE) / 8) /* 16 */
#define SHORT_MAX 240                                    /* XXH3's short-input limit */
#define COPY_BLOCK (16 * 1024)                           /* hashed, then copied from L1 */

static const uint64_t P32_1 = 0x9E3779B1U, P32_2 = 0x85EBCA77U, P32_3 = 0xC2B2AE3DU;
static const uint64_t P64_1 = 0x9E3779B185EBCA87ULL, P64_2 = 0xC2B2AE3D27D4EB4FULL, P64_3 = 0x165667B19E3779F9ULL;
static const uint64_t P64_4 = 0x85EBCA77C2B2AE63ULL, P64_5 = 0x27D4EB2F165667C5ULL, PRIME_MX1 = 0x165667919E3779F9ULL;

/* XXH3's default secret (its specification's kSecret). */
static const uint8_t SECRET[SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

static inline uint64_t read64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* little-endian hosts only: see the check in PyInit__pagecopy */
    return v;
}

/* The long-input state: eight accumulators and how many stripes went in. */
typedef struct {
    uint64_t acc[8];
    size_t stripes;
} Hash;

static void hash_init(Hash *h) {
    const uint64_t init[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    memcpy(h->acc, init, sizeof(init));
    h->stripes = 0;
}

static void stripe_scalar(uint64_t *acc, const uint8_t *in, const uint8_t *key) {
    for (int i = 0; i < 8; i++) {
        uint64_t data = read64(in + 8 * i), mixed = data ^ read64(key + 8 * i);
        acc[i ^ 1] += data;
        acc[i] += (mixed & 0xFFFFFFFFULL) * (mixed >> 32);
    }
}

static void scramble_scalar(uint64_t *acc, const uint8_t *key) {
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= read64(key + 8 * i);
        acc[i] = a * P32_1;
    }
}

/* n stripes from `in`, the state's next ones (n keeps within the normal stripes). */
static void stripes_scalar(Hash *h, const uint8_t *in, uint8_t *out, size_t n) {
    if (out != NULL) {
        memcpy(out, in, n * STRIPE);
    }
    for (size_t s = 0; s < n; s++) {
        stripe_scalar(h->acc, in + STRIPE * s, SECRET + 8 * (h->stripes % STRIPES_PER_BLOCK));
        if (++h->stripes % STRIPES_PER_BLOCK == 0) {
            scramble_scalar(h->acc, SECRET + SECRET_SIZE - STRIPE);
        }
    }
}

#ifdef HAVE_X86
__attribute__((target("avx2"))) static void stripes_avx2(Hash *h, const uint8_t *in, uint8_t *out, size_t n) {
    __m256i acc[2] = {_mm256_loadu_si256((const __m256i *)h->acc), _mm256_loadu_si256((const __m256i *)(h->acc + 4))};
    const __m256i prime = _mm256_set1_epi32((int)P32_1);
    const uint8_t *scramble_key = SECRET + SECRET_SIZE - STRIPE;
    for (size_t s = 0; s < n; s++) {
        const uint8_t *key = SECRET + 8 * (h->stripes % STRIPES_PER_BLOCK);
        for (int i = 0; i < 2; i++) {
            __m256i data = _mm256_loadu_si256((const __m256i *)(in + STRIPE * s + 32 * i));
            if (out != NULL) {
                _mm256_storeu_si256((__m256i *)(out + STRIPE * s + 32 * i), data);
            }
            __m256i mixed = _mm256_xor_si256(data, _mm256_loadu_si256((const __m256i *)(key + 32 * i)));
            __m256i product = _mm256_mul_epu32(mixed, _mm256_srli_epi64(mixed, 32));
            __m256i swapped = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2)); /* lane i gets i ^ 1 */
            acc[i] = _mm256_add_epi64(acc[i], _mm256_add_epi64(product, swapped));
        }
        if (++h->stripes % STRIPES_PER_BLOCK == 0) {
            for (int i = 0; i < 2; i++) {
                __m256i a = _mm256_xor_si256(acc[i], _mm256_srli_epi64(acc[i], 47));
                a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)(scramble_key + 32 * i)));
                __m256i low = _mm256_mul_epu32(a, prime);
                __m256i high = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime);
                acc[i] = _mm256_add_epi64(low, _mm256_slli_epi64(high, 32));
            }
        }
    }
    _mm256_storeu_si256((__m256i *)h->acc, acc[0]);
    _mm256_storeu_si256((__m256i *)(h->acc + 4), acc[1]);
}
#endif

static void (*stripes)(Hash *, const uint8_t *, uint8_t *, size_t) = stripes_scalar;

static uint64_t mul128_fold64(uint64_t a, uint64_t b) {
    __uint128_t product = (__uint128_t)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

/* The digest of `len` bytes whose normal stripes went in, given their last 64 bytes. */
static uint64_t hash_final(Hash *h, const uint8_t *last_stripe, size_t len) {
    stripe_scalar(h->acc, last_stripe, SECRET + SECRET_SIZE - STRIPE - 7);
    uint64_t result = (uint64_t)len * P64_1;
    for (int i = 0; i < 4; i++) {
        const uint8_t *key = SECRET + 11 + 16 * i;
        result += mul128_fold64(h->acc[2 * i] ^ read64(key), h->acc[2 * i + 1] ^ read64(key + 8));
    }
    result ^= result >> 37;
    result *= PRIME_MX1;
    return result ^ (result >> 32);
}

/* The normal stripes of `len` bytes: all whole stripes but the one holding the last byte. */
static size_t normal_stripes(size_t len) { return (len - 1) / STRIPE; }

/* xxh3-64 of the concatenation of runs (len > SHORT_MAX). */
static uint64_t hash_segments(const Py_buffer *runs, Py_ssize_t count, size_t len) {
    Hash h;
    hash_init(&h);
    const size_t wanted = normal_stripes(len);
    uint8_t carry[STRIPE];
    size_t carried = 0;
    for (Py_ssize_t r = 0; r < count && h.stripes < wanted; r++) {
        const uint8_t *p = runs[r].buf;
        size_t n = (size_t)runs[r].len;
        while (n > 0 && h.stripes < wanted) {
            if (carried == 0 && n >= STRIPE) {
                size_t whole = n / STRIPE;
                if (whole > wanted - h.stripes) {
                    whole = wanted - h.stripes;
                }
                stripes(&h, p, NULL, whole);
                p += whole * STRIPE;
                n -= whole * STRIPE;
                continue;
            }
            size_t take = STRIPE - carried < n ? STRIPE - carried : n;
            memcpy(carry + carried, p, take);
            carried += take;
            p += take;
            n -= take;
            if (carried == STRIPE) {
                stripes(&h, carry, NULL, 1);
                carried = 0;
            }
        }
    }
    uint8_t last[STRIPE]; /* the last 64 bytes, gathered from the runs' ends */
    size_t need = STRIPE;
    for (Py_ssize_t r = count - 1; r >= 0 && need > 0; r--) {
        size_t n = (size_t)runs[r].len, take = n < need ? n : need;
        memcpy(last + need - take, (const uint8_t *)runs[r].buf + n - take, take);
        need -= take;
    }
    return hash_final(&h, last, len);
}

/* --- SIGBUS from a mapped source, caught for the copying thread only ---------------------- */

static _Thread_local sigjmp_buf *bus_jump;
static _Thread_local const uint8_t *bus_lo, *bus_hi;
static struct sigaction previous_bus;

static void on_bus(int sig, siginfo_t *info, void *context) {
    const uint8_t *at = info ? (const uint8_t *)info->si_addr : NULL;
    if (bus_jump != NULL && at >= bus_lo && at < bus_hi) {
        siglongjmp(*bus_jump, 1);
    }
    if (previous_bus.sa_flags & SA_SIGINFO) {
        previous_bus.sa_sigaction(sig, info, context);
    } else if (previous_bus.sa_handler != SIG_DFL && previous_bus.sa_handler != SIG_IGN) {
        previous_bus.sa_handler(sig);
    } else { /* the default: die of this signal, as without this handler */
        signal(sig, SIG_DFL);
        raise(sig);
    }
}

/* Make on_bus the SIGBUS handler (again, if someone replaced it since), chaining to theirs. */
static int ensure_bus_handler(void) {
    struct sigaction current;
    if (sigaction(SIGBUS, NULL, &current) != 0) {
        return -1;
    }
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_bus) {
        return 0;
    }
    struct sigaction mine;
    memset(&mine, 0, sizeof(mine));
    mine.sa_sigaction = on_bus;
    mine.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&mine.sa_mask);
    previous_bus = current;
    return sigaction(SIGBUS, &mine, NULL);
}

/* --- Python-facing ------------------------------------------------------------------------- */

/* A sequence of runs as contiguous buffers (writable if asked), in a new array of *count. */
static Py_buffer *get_runs(PyObject *seq, int writable, Py_ssize_t *count, size_t *total) {
    PyObject *fast = PySequence_Fast(seq, "runs must be a sequence of buffers");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Py_buffer *views = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Py_buffer));
    if (views == NULL) {
        Py_DECREF(fast);
        return (Py_buffer *)PyErr_NoMemory();
    }
    *total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, i), &views[i], flags) != 0) {
            while (--i >= 0) {
                PyBuffer_Release(&views[i]);
            }
            PyMem_Free(views);
            Py_DECREF(fast);
            return NULL;
        }
        *total += (size_t)views[i].len;
    }
    Py_DECREF(fast);
    *count = n;
    return views;
}

static void release_runs(Py_buffer *views, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) {
        PyBuffer_Release(&views[i]);
    }
    PyMem_Free(views);
}

static PyObject *hash_runs(PyObject *module, PyObject *seq) {
    (void)module;
    Py_ssize_t count;
    size_t total;
    Py_buffer *views = get_runs(seq, 0, &count, &total);
    if (views == NULL) {
        return NULL;
    }
    if (total <= SHORT_MAX) {
        release_runs(views, count);
        Py_RETURN_NONE;
    }
    uint64_t digest;
    Py_BEGIN_ALLOW_THREADS
    digest = hash_segments(views, count, total);
    Py_END_ALLOW_THREADS
    release_runs(views, count);
    return PyLong_FromUnsignedLongLong(digest);
}

/* Copy [src, src + total) into the runs, hashing each block as it passes; 0, or 1 if the
 * source faulted (SIGBUS) part way (only when guarded). */
static int copy_hash_blocks(const uint8_t *src, size_t total, const Py_buffer *runs, int guard, uint64_t *digest) {
    sigjmp_buf jump;
    if (guard) {
        if (sigsetjmp(jump, 1) != 0) {
            bus_jump = NULL;
            return 1;
        }
        bus_lo = src;
        bus_hi = src + total;
        bus_jump = &jump;
    }
    Hash h;
    hash_init(&h);
    const size_t wanted = normal_stripes(total);
    const Py_buffer *run = runs;
    size_t in_run = 0;
    for (size_t done = 0; done < total;) {
        size_t block = total - done < COPY_BLOCK ? total - done : COPY_BLOCK;
        size_t n = block / STRIPE; /* blocks start on stripes: COPY_BLOCK is a multiple of 64 */
        if (n > wanted - h.stripes) {
            n = wanted - h.stripes;
        }
        size_t left = block;
        if (n > 0 && (size_t)run->len - in_run >= n * STRIPE) { /* its stripes in one run: stored as loaded */
            stripes(&h, src + done, (uint8_t *)run->buf + in_run, n);
            in_run += n * STRIPE;
            left -= n * STRIPE;
            if (in_run == (size_t)run->len) {
                run++;
                in_run = 0;
            }
        } else {
            stripes(&h, src + done, NULL, n);
        }
        while (left > 0) {
            size_t room = (size_t)run->len - in_run, take = left < room ? left : room;
            memcpy((uint8_t *)run->buf + in_run, src + done + (block - left), take);
            left -= take;
            in_run += take;
            if (in_run == (size_t)run->len) {
                run++;
                in_run = 0;
            }
        }
        done += block;
    }
    *digest = hash_final(&h, src + total - STRIPE, total);
    bus_jump = NULL;
    return 0;
}

/* Whether every memory page under [src, src + len) is resident (mincore). */
static int resident(const uint8_t *src, size_t len) {
    size_t pagesize = (size_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = (uintptr_t)src & ~(uintptr_t)(pagesize - 1), hi = (uintptr_t)src + len;
    size_t pages = (hi - lo + pagesize - 1) / pagesize;
    unsigned char small[4096], *vec = pages <= sizeof(small) ? small : malloc(pages);
    int all = vec != NULL && mincore((void *)lo, hi - lo, vec) == 0;
    for (size_t i = 0; all && i < pages; i++) {
        all = vec[i] & 1;
    }
    if (vec != small) {
        free(vec);
    }
    return all;
}

/* copy_hash(runs, source, offset, mapped) -> int | None */
static PyObject *copy_hash(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "copy_hash(runs, source, offset, mapped) takes 4 arguments");
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[2]);
    int mapped = PyObject_IsTrue(args[3]);
    if ((offset == -1 && PyErr_Occurred()) || mapped < 0) {
        return NULL;
    }
    if (mapped && ensure_bus_handler() != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_buffer source;
    if (PyObject_GetBuffer(args[1], &source, PyBUF_C_CONTIGUOUS) != 0) {
        return NULL;
    }
    Py_ssize_t count;
    size_t total;
    Py_buffer *views = get_runs(args[0], 1, &count, &total);
    if (views == NULL) {
        PyBuffer_Release(&source);
        return NULL;
    }
    PyObject *result = NULL;
    if (offset < 0 || offset > source.len || total > (size_t)(source.len - offset)) {
        PyErr_Format(PyExc_ValueError, "copy_hash: %zu bytes at offset %zd of a %zd-byte source", total, offset,
                     source.len);
    } else if (total <= SHORT_MAX) {
        result = Py_NewRef(Py_None);
    } else {
        const uint8_t *src = (const uint8_t *)source.buf + offset;
        int copied = 0;
        uint64_t digest = 0;
        Py_BEGIN_ALLOW_THREADS
        copied = (!mapped || resident(src, total)) && copy_hash_blocks(src, total, views, mapped, &digest) == 0;
        Py_END_ALLOW_THREADS
        result = copied ? PyLong_FromUnsignedLongLong(digest) : Py_NewRef(Py_None);
    }
    release_runs(views, count);
    PyBuffer_Release(&source);
    return result;
}

/* use_avx2(flag) -> bool: choose the AVX2 stripes (where the CPU has them) or the scalar ones,
 * which tests compare; whether AVX2 is in use after. */
static PyObject *use_avx2(PyObject *module, PyObject *flag) {
    (void)module;
    int want = PyObject_IsTrue(flag);
    if (want < 0) {
        return NULL;
    }
    stripes = stripes_scalar;
#ifdef HAVE_X86
    if (want && __builtin_cpu_supports("avx2")) {
        stripes = stripes_avx2;
    }
#endif
    return PyBool_FromLong(stripes != stripes_scalar);
}

static PyMethodDef methods[] = {
    {"hash_runs", hash_runs, METH_O, "xxh3-64 of the runs' bytes in order, or None for 240 bytes or fewer."},
    {"copy_hash", (PyCFunction)(void (*)(void))copy_hash, METH_FASTCALL,
     "Copy the runs' total bytes from source[offset:] into the runs and return their xxh3-64, in one pass; None "
     "for 240 bytes or fewer, or (mapped: a file's mapping) when a source page is not in memory or faulted."},
    {"use_avx2", use_avx2, METH_O, "Use the AVX2 stripes if the CPU has them (True) or the scalar ones (False)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvray.core._pagecopy", "Page copies hashed in the same pass (see kvray.core.pages).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__pagecopy(void) {
    const uint16_t probe = 1;
    if (*(const uint8_t *)&probe != 1) {
        PyErr_SetString(PyExc_ImportError, "kvray.core._pagecopy reads words little-endian");
        return NULL;
    }
#ifdef HAVE_X86
    __builtin_cpu_init();
#endif
    PyObject *module = PyModule_Create(&module_def);
    if (module != NULL) {
        Py_XDECREF(use_avx2(module, Py_True));
    }
    return module;
}
