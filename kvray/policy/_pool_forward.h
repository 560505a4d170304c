/* The reuse model's forward pass in C: ReuseModel.predict (kvray/policy/reuse_model.py), for
 * kvray/policy/_pool.c's forward() and ranked(); included once, by _pool.c.
 *
 *   rows float32 (n x F), mean and scale float32 (F), w1 float32 (F x H), b1 and w2 float32 (H),
 *   b2 float32 (1). Each row standardised as numpy does it ((x - mean) / scale, in float32),
 *   its hidden units as fused multiply-adds over the features in order from 0 (what OpenBLAS's
 *   small sgemm kernels do on this repository's machines), plus b1, ReLU, and the output as
 *   fused multiply-adds over the hidden units in order, plus b2. numpy's product of the hidden
 *   layer and w2 is a BLAS gemv whose sums run in another, CPU-dependent order, so a score can
 *   differ from predict's in its last bits (tests/policy/test_reuse_pool.py bounds it, and checks
 *   that a replay's decisions are the same). Compiled with -ffp-contract=off (setup.py): the
 *   compiler fuses nothing else. Where the CPU has AVX and FMA, in AVX (forward_fma), else (or
 *   with `portable`) row by row in libm's fmaf: the same scores, bit for bit. */
#ifndef KVRAY_POOL_FORWARD_H
#define KVRAY_POOL_FORWARD_H
#include <math.h>
#define MAX_WIDTH 256 /* features or hidden units of a row */
#define BLOCK_ROWS 4 /* rows scored together in AVX: independent sums for the CPU to overlap */
#define BLOCK_UNITS 8 /* hidden units summed together (one AVX vector) */

typedef struct {
    Py_ssize_t F, H;
    const float *mean, *scale, *w1, *b1, *w2;
    float b2;
} Model;

/* The scores of n rows into out, one row at a time (forward_fma below: the same operations, in AVX). */
static inline __attribute__((always_inline)) void forward_rows(const Model *m, const float *rows, Py_ssize_t n, float *out) {
    float x[MAX_WIDTH], hidden[MAX_WIDTH];
    Py_ssize_t F = m->F, H = m->H;
    for (Py_ssize_t i = 0; i < n; i++) {
        const float *row = rows + i * F;
        for (Py_ssize_t f = 0; f < F; f++) x[f] = (row[f] - m->mean[f]) / m->scale[f];
        for (Py_ssize_t j = 0; j < H; j++) hidden[j] = 0.0f;
        for (Py_ssize_t f = 0; f < F; f++) /* by feature: each unit's sum still in feature order */
            for (Py_ssize_t j = 0; j < H; j++) hidden[j] = fmaf(x[f], m->w1[f * H + j], hidden[j]);
        float score = 0.0f;
        for (Py_ssize_t j = 0; j < H; j++) {
            float v = hidden[j] + m->b1[j];
            score = fmaf(v > 0.0f || v != v ? v : 0.0f, m->w2[j], score); /* np.maximum(v, 0): NaN stays */
        }
        out[i] = score + m->b2;
    }
}

/* libm's fmaf is exact wherever it runs (in software without the instruction): the same scores, slower */
static void forward_any(const Model *m, const float *rows, Py_ssize_t n, float *out) { forward_rows(m, rows, n, out); }
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define FORWARD_DISPATCH 1
#include <immintrin.h>
/* forward_rows in AVX: eight hidden units of four rows per step, each lane the same fused
 * multiply-add (vfmadd's lanes round as fmaf does) in the same feature order. */
__attribute__((target("avx,fma"))) static void forward_fma(const Model *m, const float *rows, Py_ssize_t n, float *out) {
    Py_ssize_t F = m->F, H = m->H;
    if (H % BLOCK_UNITS != 0) {
        forward_rows(m, rows, n, out);
        return;
    }
    float x[BLOCK_ROWS][MAX_WIDTH], hidden[BLOCK_ROWS][MAX_WIDTH];
    for (Py_ssize_t i = 0; i < n; i += BLOCK_ROWS) {
        Py_ssize_t take = n - i < BLOCK_ROWS ? n - i : BLOCK_ROWS;
        for (Py_ssize_t r = 0; r < BLOCK_ROWS; r++) {
            const float *row = rows + (i + (r < take ? r : 0)) * F; /* a block's missing rows repeat its first */
            for (Py_ssize_t f = 0; f < F; f++) x[r][f] = (row[f] - m->mean[f]) / m->scale[f];
        }
        for (Py_ssize_t j0 = 0; j0 < H; j0 += BLOCK_UNITS) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (Py_ssize_t f = 0; f < F; f++) {
                __m256 w = _mm256_loadu_ps(m->w1 + f * H + j0);
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(x[0][f]), w, a0);
                a1 = _mm256_fmadd_ps(_mm256_set1_ps(x[1][f]), w, a1);
                a2 = _mm256_fmadd_ps(_mm256_set1_ps(x[2][f]), w, a2);
                a3 = _mm256_fmadd_ps(_mm256_set1_ps(x[3][f]), w, a3);
            }
            _mm256_storeu_ps(hidden[0] + j0, a0);
            _mm256_storeu_ps(hidden[1] + j0, a1);
            _mm256_storeu_ps(hidden[2] + j0, a2);
            _mm256_storeu_ps(hidden[3] + j0, a3);
        }
        float score[BLOCK_ROWS] = {0.0f};
        for (Py_ssize_t j = 0; j < H; j++)
            for (int r = 0; r < BLOCK_ROWS; r++) {
                float v = hidden[r][j] + m->b1[j];
                score[r] = fmaf(v > 0.0f || v != v ? v : 0.0f, m->w2[j], score[r]);
            }
        for (Py_ssize_t r = 0; r < take; r++) out[i + r] = score[r] + m->b2;
    }
}
#else
#define FORWARD_DISPATCH 0
#endif

static const char *MODEL_NAMES[6] = {"mean", "scale", "w1", "b1", "w2", "b2"};

/* The weights from their buffers (mean, scale, w1, b1, w2, b2) into *m; -1 with an exception set
 * when their shapes disagree or are wider than MAX_WIDTH. */
static int load_model(Model *m, const Py_buffer w[6]) {
    Py_ssize_t F = w[0].len / 4, H = w[3].len / 4;
    if (F < 1 || F > MAX_WIDTH || H < 1 || H > MAX_WIDTH || w[1].len / 4 != F || w[2].len / 4 != F * H || w[4].len / 4 != H ||
        w[5].len / 4 < 1) {
        PyErr_SetString(PyExc_ValueError, "forward: mean and scale (F), w1 (F x H), b1 and w2 (H), b2 (1)");
        return -1;
    }
    *m = (Model){F, H, w[0].buf, w[1].buf, w[2].buf, w[3].buf, w[4].buf, ((const float *)w[5].buf)[0]};
    return 0;
}

/* The scores of n rows (n x m->F) into out: in AVX where the CPU has it, unless `portable`. */
static void score_rows(const Model *m, const float *rows, Py_ssize_t n, float *out, int portable) {
#if FORWARD_DISPATCH
    if (!portable && __builtin_cpu_supports("avx") && __builtin_cpu_supports("fma")) {
        forward_fma(m, rows, n, out);
        return;
    }
#endif
    (void)portable;
    forward_any(m, rows, n, out);
}

#endif
