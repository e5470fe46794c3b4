/*
 * Crop, resize and store: a decoded RGBX region -> one sample of the batch.
 *
 * gf_resize_store resamples a box of an RGBX image to the output size
 * (bilinear, bicubic or Lanczos) with either of PIL's arithmetics (Pillow's
 * 22-bit coefficients, or Pillow-SIMD's 16-bit ones: `mode`), so its pixels
 * equal that PIL's `Image.resize(size, filter, box)` bit for bit. gpufeed
 * itself always runs the 16-bit one, the fastest, whichever PIL is active.
 * Each output row goes straight from registers/L1 into the batch's layout
 * (planar or interleaved, uint8 or normalised float32, mirrored when asked):
 * no intermediate image, no paste, no second pass over memory. gf_crop_many plans, decodes and
 * resizes a whole batch piece in one call that holds no Python lock.
 *
 * x86-64 machines with AVX2 take the vector kernels (chosen at run time);
 * others the scalar ones, with identical results.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gpufeed.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(GF_NO_SIMD) /* -DGF_NO_SIMD: the portable build */
#include <immintrin.h>
#define GF_X86 1
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

#define GF_MAX_ROW 4096

/* ------------------------------------------------------------------------ */
/* Storing rows                                                             */

/*
 * One RGBX row -> three uint8 channels addressed by element strides (planar
 * CHW, interleaved HWC...), mirrored left-right when `flip`.
 */
static void gf_row_u8(const unsigned char *restrict row, int w, int flip, unsigned char *restrict out, long stride_c,
                      long stride_x) {
    int x, c;
    for (c = 0; c < 3; c++) {
        unsigned char *restrict target = out + c * stride_c;
        if (stride_x == 1 && !flip) { /* planar: contiguous rows, vectorised */
            for (x = 0; x < w; x++) {
                target[x] = row[x * 4 + c];
            }
        } else if (stride_x == 1 && w <= GF_MAX_ROW) { /* mirrored: forward, then reversed 8 bytes at a time */
            unsigned char forward[GF_MAX_ROW];
            int words = w / 8, rest = w - words * 8;
            for (x = 0; x < w; x++) {
                forward[x] = row[x * 4 + c];
            }
            for (x = 0; x < words; x++) {
                unsigned long long word;
                memcpy(&word, forward + w - 8 * (x + 1), 8);
                word = __builtin_bswap64(word);
                memcpy(target + 8 * x, &word, 8);
            }
            for (x = 0; x < rest; x++) {
                target[words * 8 + x] = forward[rest - 1 - x];
            }
        } else {
            long step = flip ? -stride_x : stride_x;
            target += flip ? (long)(w - 1) * stride_x : 0;
            for (x = 0; x < w; x++) {
                target[x * step] = row[x * 4 + c];
            }
        }
    }
}

/*
 * The same to float32 with out = value * scale[c] + shift[c] (strides in
 * floats): the CPU device's conversion and normalisation fused into the one
 * write of the batch output. The batch is far larger than the caches and is
 * not read again here, so whole 16-byte groups go out with streaming stores:
 * no read of the old contents first, half the memory traffic.
 */
static void gf_row_f32(const unsigned char *restrict row, int w, int flip, float *restrict out, long stride_c,
                       long stride_x, const float *scale, const float *shift) {
    int x, c;
    for (c = 0; c < 3; c++) {
        float *restrict target = out + c * stride_c;
        float a = scale[c], b = shift[c];
        x = 0;
        if (stride_x != 1) {
            long step = flip ? -stride_x : stride_x;
            target += flip ? (long)(w - 1) * stride_x : 0;
            for (; x < w; x++) {
                target[x * step] = row[x * 4 + c] * a + b;
            }
            continue;
        }
#if defined(__SSE2__)
        {
            const __m128 va = _mm_set1_ps(a), vb = _mm_set1_ps(b);
            const __m128i byte = _mm_set1_epi32(255);
            for (; x < w && ((uintptr_t)(target + x) & 15) != 0; x++) {
                target[x] = row[(flip ? w - 1 - x : x) * 4 + c] * a + b;
            }
            for (; x + 4 <= w; x += 4) {
                __m128i pixels = _mm_loadu_si128((const __m128i *)(row + (size_t)(flip ? w - 4 - x : x) * 4));
                __m128i values = _mm_and_si128(_mm_srli_epi32(pixels, 8 * c), byte);
                if (flip) {
                    values = _mm_shuffle_epi32(values, _MM_SHUFFLE(0, 1, 2, 3));
                }
                _mm_stream_ps(target + x, _mm_add_ps(_mm_mul_ps(_mm_cvtepi32_ps(values), va), vb));
            }
        }
#endif
        for (; x < w; x++) {
            target[x] = row[(flip ? w - 1 - x : x) * 4 + c] * a + b;
        }
    }
}

/* Where and how rows go: uint8 (scale == NULL) or float32 output, element strides. */
struct gf_target {
    void *out;
    long stride_c, stride_y, stride_x;
    int flip;
    const float *scale, *shift;
};

static void gf_store_row(const struct gf_target *t, const unsigned char *row, int w, int y) {
    if (t->scale == NULL) {
        gf_row_u8(row, w, t->flip, (unsigned char *)t->out + y * t->stride_y, t->stride_c, t->stride_x);
    } else {
        gf_row_f32(row, w, t->flip, (float *)t->out + y * t->stride_y, t->stride_c, t->stride_x, t->scale, t->shift);
    }
}

static void gf_store_done(const struct gf_target *t) {
#if defined(__SSE2__)
    if (t->scale != NULL) {
        _mm_sfence(); /* the streamed rows are visible before the batch is handed on */
    }
#else
    (void)t;
#endif
}

/* RGBX pixels (w x h, rows packed) -> the output, uint8. */
void gf_store_rgbx(const unsigned char *restrict src, int w, int h, int flip, unsigned char *restrict out,
                   long stride_c, long stride_y, long stride_x) {
    struct gf_target t = {out, stride_c, stride_y, stride_x, flip, NULL, NULL};
    int y;
    for (y = 0; y < h; y++) {
        gf_store_row(&t, src + (size_t)y * w * 4, w, y);
    }
}

/* The same to float32, out = value * scale[c] + shift[c] (strides in floats). */
void gf_store_rgbx_f32(const unsigned char *restrict src, int w, int h, int flip, float *restrict out, long stride_c,
                       long stride_y, long stride_x, const float *scale, const float *shift) {
    struct gf_target t = {out, stride_c, stride_y, stride_x, flip, scale, shift};
    int y;
    for (y = 0; y < h; y++) {
        gf_store_row(&t, src + (size_t)y * w * 4, w, y);
    }
    gf_store_done(&t);
}

/* ------------------------------------------------------------------------ */
/* Filter coefficients, as PIL's Resample.c computes them                  */


struct gf_axis {
    int ksize;     /* coefficients per output pixel (the rest zero) */
    int precision; /* fixed-point bits */
    int *first;    /* per output pixel: first input pixel */
    int *count;    /* per output pixel: input pixels read */
    int32_t *k;    /* out x ksize fixed-point weights */
};

static double gf_triangle(double x) {
    x = x < 0.0 ? -x : x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

static double gf_cubic(double x) { /* Keys, a = -0.5 */
    x = x < 0.0 ? -x : x;
    if (x < 1.0) {
        return (1.5 * x - 2.5) * x * x + 1;
    }
    return x < 2.0 ? (((x - 5) * x + 8) * x - 4) * -0.5 : 0.0;
}

static double gf_sinc(double x) {
    if (x == 0.0) {
        return 1.0;
    }
    x = x * 3.14159265358979323846; /* M_PI */
    return sin(x) / x;
}

/* Lanczos-3 from a table of 1024 steps per unit, linearly interpolated (error
 * under 2e-6, far below the 16-bit weights): two sin() per tap cost more than
 * the plane resize itself. Filled when the library loads. */
#define GF_LANCZOS_STEPS 1024
static double gf_lanczos_table[3 * GF_LANCZOS_STEPS + 2];

__attribute__((constructor)) static void gf_lanczos_fill(void) {
    for (int i = 0; i <= 3 * GF_LANCZOS_STEPS + 1; i++) {
        double x = (double)i / GF_LANCZOS_STEPS;
        gf_lanczos_table[i] = x < 3.0 ? gf_sinc(x) * gf_sinc(x / 3) : 0.0;
    }
}

static double gf_lanczos3(double x) {
    x = x < 0.0 ? -x : x;
    if (x >= 3.0) {
        return 0.0;
    }
    double position = x * GF_LANCZOS_STEPS;
    int i = (int)position;
    double fraction = position - i;
    return gf_lanczos_table[i] + (gf_lanczos_table[i + 1] - gf_lanczos_table[i]) * fraction;
}

static void gf_axis_free(struct gf_axis *axis) {
    free(axis->first);
    free(axis->k);
    axis->first = NULL;
    axis->k = NULL;
}

/* Weights for out_size pixels over [in0, in1) of in_size; 0, or -1 when out of memory. */
static int gf_axis_make(struct gf_axis *axis, int in_size, float in0, float in1, int out_size, int mode, int filter) {
    double (*kernel)(double) = filter == GF_LANCZOS ? gf_lanczos3 : (filter == GF_BICUBIC ? gf_cubic : gf_triangle);
    double reach = filter == GF_LANCZOS ? 3.0 : (filter == GF_BICUBIC ? 2.0 : 1.0);
    double scale = (double)(in1 - in0) / out_size, filterscale = scale < 1.0 ? 1.0 : scale; /* PIL's box is float */
    double support = reach * filterscale, ss = 1.0 / filterscale, maxkk = 0.0;
    int ksize = (int)ceil(support) * 2 + 1, xx, x, precision;
    double *weights = malloc(sizeof(double) * (size_t)out_size * ksize);

    axis->first = malloc(sizeof(int) * 2 * (size_t)out_size);
    axis->k = malloc(sizeof(int32_t) * (size_t)out_size * ksize);
    if (weights == NULL || axis->first == NULL || axis->k == NULL) {
        free(weights);
        gf_axis_free(axis);
        return -1;
    }
    axis->count = axis->first + out_size;
    axis->ksize = ksize;
    for (xx = 0; xx < out_size; xx++) {
        double center = in0 + (xx + 0.5) * scale, total = 0.0, *w = weights + (size_t)xx * ksize;
        int xmin = (int)(center - support + 0.5), xmax = (int)(center + support + 0.5);
        xmin = xmin < 0 ? 0 : xmin;
        xmax = (xmax > in_size ? in_size : xmax) - xmin;
        for (x = 0; x < xmax; x++) {
            w[x] = kernel((x + xmin - center + 0.5) * ss);
            total += w[x];
        }
        for (x = 0; x < xmax; x++) {
            w[x] = total != 0.0 ? w[x] / total : w[x];
            maxkk = w[x] > maxkk ? w[x] : maxkk;
        }
        for (; x < ksize; x++) {
            w[x] = 0.0;
        }
        axis->first[xx] = xmin;
        axis->count[xx] = xmax < 0 ? 0 : xmax;
    }
    precision = 22;
    if (mode == GF_PILLOW_SIMD) { /* the most bits that keep every weight under 2^15 */
        for (precision = 0; precision < 22; precision++) {
            if ((int)(0.5 + maxkk * (1 << (precision + 1))) >= (1 << 15)) {
                break;
            }
        }
    }
    axis->precision = precision;
    for (x = 0; x < out_size * ksize; x++) {
        double v = weights[x] * (1 << precision);
        axis->k[x] = (int32_t)(weights[x] < 0 ? v - 0.5 : v + 0.5);
    }
    free(weights);
    return 0;
}

static unsigned char gf_clip8(int32_t v, int precision) {
    v >>= precision;
    return (unsigned char)(v < 0 ? 0 : (v > 255 ? 255 : v));
}

/* ------------------------------------------------------------------------ */
/* The two passes, scalar                                                   */

static void gf_horizontal_row(const unsigned char *in, unsigned char *out, int out_w, const struct gf_axis *a) {
    int xx, x, c;
    const int32_t half = 1 << (a->precision - 1);
    for (xx = 0; xx < out_w; xx++) {
        const unsigned char *p = in + (size_t)a->first[xx] * 4;
        const int32_t *k = a->k + (size_t)xx * a->ksize;
        for (c = 0; c < 4; c++) {
            int32_t sum = half;
            for (x = 0; x < a->count[xx]; x++) {
                sum += p[x * 4 + c] * k[x];
            }
            out[xx * 4 + c] = gf_clip8(sum, a->precision);
        }
    }
}

static void gf_vertical_row(const unsigned char *in, long in_stride, unsigned char *out, int bytes,
                            const struct gf_axis *a, int yy) {
    int x, y;
    const int32_t half = 1 << (a->precision - 1);
    const unsigned char *rows = in + (size_t)a->first[yy] * in_stride;
    const int32_t *k = a->k + (size_t)yy * a->ksize;
    for (x = 0; x < bytes; x++) {
        int32_t sum = half;
        for (y = 0; y < a->count[yy]; y++) {
            sum += rows[y * in_stride + x] * k[y];
        }
        out[x] = gf_clip8(sum, a->precision);
    }
}

/* ------------------------------------------------------------------------ */
/* The two passes, AVX2 (Pillow-SIMD's 16-bit weights only: pmaddwd)        */

#ifdef GF_X86
/* Per output pixel: its weights in 16-bit pairs (lo = k[t], hi = k[t + 1], zero past its count). */
static int32_t *gf_pairs(const struct gf_axis *a, int out_size) {
    int pairs = (a->ksize + 1) / 2, xx, t;
    int32_t *packed = malloc(sizeof(int32_t) * (size_t)out_size * pairs);
    if (packed == NULL) {
        return NULL;
    }
    for (xx = 0; xx < out_size; xx++) {
        const int32_t *k = a->k + (size_t)xx * a->ksize;
        for (t = 0; t < pairs; t++) {
            int32_t lo = k[2 * t], hi = 2 * t + 1 < a->count[xx] ? k[2 * t + 1] : 0;
            packed[(size_t)xx * pairs + t] = (int32_t)((uint32_t)(uint16_t)lo | ((uint32_t)(uint16_t)hi << 16));
        }
    }
    return packed;
}

/* Pixels first+t and first+t+1 of two rows, one row per 128-bit lane, as 16-bit channel pairs. */
__attribute__((target("avx2"))) static inline __m256i gf_pixel_pairs(const unsigned char *a, const unsigned char *b,
                                                                      int at, int two) {
    const __m256i spread = _mm256_setr_epi8(0, -1, 4, -1, 1, -1, 5, -1, 2, -1, 6, -1, 3, -1, 7, -1, 0, -1, 4, -1, 1,
                                            -1, 5, -1, 2, -1, 6, -1, 3, -1, 7, -1);
    __m128i lo, hi;
    if (two) {
        lo = _mm_loadl_epi64((const __m128i *)(a + (size_t)at * 4));
        hi = _mm_loadl_epi64((const __m128i *)(b + (size_t)at * 4));
    } else { /* the last pixel of the row alone: never read past it */
        int32_t p0, p1;
        memcpy(&p0, a + (size_t)at * 4, 4);
        memcpy(&p1, b + (size_t)at * 4, 4);
        lo = _mm_cvtsi32_si128(p0);
        hi = _mm_cvtsi32_si128(p1);
    }
    return _mm256_shuffle_epi8(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1), spread);
}

/* One output pixel of four rows (two per register, one per lane), any number of weights. */
__attribute__((target("avx2"))) static inline void gf_horizontal4_one(const unsigned char *const *in,
                                                                       unsigned char *const *out, int in_w,
                                                                       const struct gf_axis *a, const int32_t *k,
                                                                       int xx, size_t at) {
    const __m256i half = _mm256_set1_epi32(1 << (a->precision - 1));
    const int first = a->first[xx], count = a->count[xx];
    __m256i s01 = half, s23 = half, packed;
    int t;
    for (t = 0; t < count; t += 2) {
        const int two = first + t + 2 <= in_w;
        const __m256i w = _mm256_set1_epi32(k[t / 2]);
        s01 = _mm256_add_epi32(s01, _mm256_madd_epi16(gf_pixel_pairs(in[0], in[1], first + t, two), w));
        s23 = _mm256_add_epi32(s23, _mm256_madd_epi16(gf_pixel_pairs(in[2], in[3], first + t, two), w));
    }
    /* lane 0: row 0 | row 2, lane 1: row 1 | row 3 */
    packed = _mm256_packs_epi32(_mm256_srai_epi32(s01, a->precision), _mm256_srai_epi32(s23, a->precision));
    packed = _mm256_packus_epi16(packed, packed);
    *(int32_t *)(out[0] + at) = _mm256_extract_epi32(packed, 0);
    *(int32_t *)(out[2] + at) = _mm256_extract_epi32(packed, 1);
    *(int32_t *)(out[1] + at) = _mm256_extract_epi32(packed, 4);
    *(int32_t *)(out[3] + at) = _mm256_extract_epi32(packed, 5);
}

/* Four pixels from `at` of two rows (one per lane). */
__attribute__((target("avx2"))) static inline __m256i gf_load4(const unsigned char *a, const unsigned char *b,
                                                                size_t at) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(a + at))),
                                   _mm_loadu_si128((const __m128i *)(b + at)), 1);
}

/*
 * Four input rows at once (two per register, one per lane), sharing each
 * output pixel's weights; the output is written mirrored when `flip`. Where
 * two neighbouring output pixels each read at most two input pixels within
 * four of the first (upscaling and mild downscaling: nearly every pixel of a
 * training crop), one load of four pixels per row serves both.
 */
__attribute__((target("avx2"))) static void gf_horizontal4_avx2(const unsigned char *const *in, unsigned char *const *out,
                                                                 int in_w, int out_w, const struct gf_axis *a,
                                                                 const int32_t *pairs, int flip) {
    const int npairs = (a->ksize + 1) / 2;
    const __m256i half = _mm256_set1_epi32(1 << (a->precision - 1));
    /* pixels d, d + 1 of four loaded -> 16-bit channel pairs, for d = 0, 1, 2 */
    const __m256i spread[3] = {
        _mm256_setr_epi8(0, -1, 4, -1, 1, -1, 5, -1, 2, -1, 6, -1, 3, -1, 7, -1, 0, -1, 4, -1, 1, -1, 5, -1, 2, -1, 6,
                         -1, 3, -1, 7, -1),
        _mm256_setr_epi8(4, -1, 8, -1, 5, -1, 9, -1, 6, -1, 10, -1, 7, -1, 11, -1, 4, -1, 8, -1, 5, -1, 9, -1, 6, -1,
                         10, -1, 7, -1, 11, -1),
        _mm256_setr_epi8(8, -1, 12, -1, 9, -1, 13, -1, 10, -1, 14, -1, 11, -1, 15, -1, 8, -1, 12, -1, 9, -1, 13, -1,
                         10, -1, 14, -1, 11, -1, 15, -1),
    };
    int xx = 0;
    while (xx < out_w) {
        const int first = a->first[xx], d = xx + 1 < out_w ? a->first[xx + 1] - first : -1;
        if (d >= 0 && d <= 2 && a->count[xx] <= 2 && a->count[xx + 1] <= 2 && first + 4 <= in_w) {
            const size_t at = (size_t)first * 4;
            const __m256i w0 = _mm256_set1_epi32(pairs[(size_t)xx * npairs]);
            const __m256i w1 = _mm256_set1_epi32(pairs[(size_t)(xx + 1) * npairs]);
            const __m256i v01 = gf_load4(in[0], in[1], at), v23 = gf_load4(in[2], in[3], at);
            __m256i a01 = _mm256_add_epi32(half, _mm256_madd_epi16(_mm256_shuffle_epi8(v01, spread[0]), w0));
            __m256i b01 = _mm256_add_epi32(half, _mm256_madd_epi16(_mm256_shuffle_epi8(v01, spread[d]), w1));
            __m256i a23 = _mm256_add_epi32(half, _mm256_madd_epi16(_mm256_shuffle_epi8(v23, spread[0]), w0));
            __m256i b23 = _mm256_add_epi32(half, _mm256_madd_epi16(_mm256_shuffle_epi8(v23, spread[d]), w1));
            /* lane 0: row 0 (xx, xx + 1) | row 2 (xx, xx + 1); lane 1: rows 1 | 3 */
            __m256i packed = _mm256_packus_epi16(
                _mm256_packs_epi32(_mm256_srai_epi32(a01, a->precision), _mm256_srai_epi32(b01, a->precision)),
                _mm256_packs_epi32(_mm256_srai_epi32(a23, a->precision), _mm256_srai_epi32(b23, a->precision)));
            __m128i lo, hi;
            size_t to = (size_t)xx * 4;
            if (flip) { /* the pair lands mirrored: swap it */
                packed = _mm256_shuffle_epi32(packed, _MM_SHUFFLE(2, 3, 0, 1));
                to = (size_t)(out_w - 2 - xx) * 4;
            }
            lo = _mm256_castsi256_si128(packed);
            hi = _mm256_extracti128_si256(packed, 1);
            _mm_storel_epi64((__m128i *)(out[0] + to), lo);
            _mm_storel_epi64((__m128i *)(out[2] + to), _mm_unpackhi_epi64(lo, lo));
            _mm_storel_epi64((__m128i *)(out[1] + to), hi);
            _mm_storel_epi64((__m128i *)(out[3] + to), _mm_unpackhi_epi64(hi, hi));
            xx += 2;
            continue;
        }
        gf_horizontal4_one(in, out, in_w, a, pairs + (size_t)xx * npairs, xx,
                           (size_t)(flip ? out_w - 1 - xx : xx) * 4);
        xx++;
    }
}

/* Eight RGBX pixels -> R0..7 | G0..7 | B0..7 | X0..7 as 64-bit quarters. */
__attribute__((target("avx2"))) static inline __m256i gf_planes8(__m256i rgbx) {
    const __m256i gather = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0, 4, 8, 12, 1, 5, 9,
                                            13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(rgbx, gather), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Eight output pixels (RGBX in a register) into planar rows at x: uint8, or float32 value * scale + shift. */
__attribute__((target("avx2"))) static inline void gf_put8(const struct gf_target *t, int y, int x, __m256i rgbx) {
    __m256i planes = gf_planes8(rgbx);
    __m128i rg = _mm256_castsi256_si128(planes), bx = _mm256_extracti128_si256(planes, 1);
    if (t->scale == NULL) {
        unsigned char *base = (unsigned char *)t->out + y * t->stride_y + x;
        _mm_storel_epi64((__m128i *)base, rg);
        _mm_storel_epi64((__m128i *)(base + t->stride_c), _mm_unpackhi_epi64(rg, rg));
        _mm_storel_epi64((__m128i *)(base + 2 * t->stride_c), bx);
    } else {
        float *base = (float *)t->out + y * t->stride_y + x;
        __m128i channel[3];
        int c;
        channel[0] = rg;
        channel[1] = _mm_unpackhi_epi64(rg, rg);
        channel[2] = bx;
        for (c = 0; c < 3; c++) {
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(channel[c]));
            v = _mm256_add_ps(_mm256_mul_ps(v, _mm256_set1_ps(t->scale[c])), _mm256_set1_ps(t->shift[c]));
            if (((uintptr_t)(base + c * t->stride_c) & 31) == 0) {
                _mm256_stream_ps(base + c * t->stride_c, v);
            } else {
                _mm256_storeu_ps(base + c * t->stride_c, v);
            }
        }
    }
}

/*
 * Output row yy from `count` rows of the horizontal pass, 32 bytes (eight
 * pixels) at a time: byte pairs of two rows -> pmaddwd. With `direct`, each
 * group of eight goes straight into the planar target; the rest (and every
 * group without `direct`) into `row` for gf_store_row.
 */
__attribute__((target("avx2"))) static int gf_vertical_avx2(const unsigned char *in, long in_stride,
                                                             unsigned char *row, int out_w, const struct gf_axis *a,
                                                             int yy, const struct gf_target *t, int direct) {
    const int count = a->count[yy], bytes = out_w * 4;
    const unsigned char *rows = in + (size_t)a->first[yy] * in_stride;
    const int32_t *k = a->k + (size_t)yy * a->ksize;
    const __m256i half = _mm256_set1_epi32(1 << (a->precision - 1)), zero = _mm256_setzero_si256();
    int x, y;
    for (x = 0; x + 32 <= bytes; x += 32) {
        __m256i s0 = half, s1 = half, s2 = half, s3 = half, packed;
        for (y = 0; y < count; y += 2) {
            __m256i r0 = _mm256_loadu_si256((const __m256i *)(rows + (size_t)y * in_stride + x));
            __m256i r1 = y + 1 < count ? _mm256_loadu_si256((const __m256i *)(rows + (size_t)(y + 1) * in_stride + x))
                                       : zero;
            int32_t hi = y + 1 < count ? k[y + 1] : 0;
            __m256i w = _mm256_set1_epi32((int32_t)((uint32_t)(uint16_t)k[y] | ((uint32_t)(uint16_t)hi << 16)));
            __m256i lo = _mm256_unpacklo_epi8(r0, r1), up = _mm256_unpackhi_epi8(r0, r1);
            s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), w));
            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), w));
            s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(_mm256_unpacklo_epi8(up, zero), w));
            s3 = _mm256_add_epi32(s3, _mm256_madd_epi16(_mm256_unpackhi_epi8(up, zero), w));
        }
        s0 = _mm256_packs_epi32(_mm256_srai_epi32(s0, a->precision), _mm256_srai_epi32(s1, a->precision));
        s2 = _mm256_packs_epi32(_mm256_srai_epi32(s2, a->precision), _mm256_srai_epi32(s3, a->precision));
        packed = _mm256_packus_epi16(s0, s2);
        if (direct) {
            gf_put8(t, yy, x / 4, packed);
        } else {
            _mm256_storeu_si256((__m256i *)(row + x), packed);
        }
    }
    for (; x < bytes; x++) {
        int32_t sum = 1 << (a->precision - 1);
        for (y = 0; y < count; y++) {
            sum += rows[(size_t)y * in_stride + x] * k[y];
        }
        row[x] = gf_clip8(sum, a->precision);
    }
    return direct ? (bytes / 32) * 8 : 0; /* pixels already stored */
}

#endif

int gf_has_avx2(void) {
#ifdef GF_X86
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return known;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------------ */
/* Resize and store                                                         */

/* Pixels [from, w) of an RGBX row into row y of the target. */
static void gf_store_tail(const struct gf_target *t, const unsigned char *row, int w, int y, int from) {
    struct gf_target rest = *t;
    if (from >= w) {
        return;
    }
    if (rest.scale == NULL) {
        rest.out = (unsigned char *)t->out + from * t->stride_x;
    } else {
        rest.out = (float *)t->out + from * t->stride_x;
    }
    gf_store_row(&rest, row + (size_t)from * 4, w - from, y);
}

/* Pillow's order when the height shrinks much more than the width: vertical pass first (scalar). */
static int gf_vertical_first(const unsigned char *src, int w, const struct gf_axis *across,
                             const struct gf_axis *down, int out_w, int out_h, const struct gf_target *t) {
    unsigned char *temp = malloc((size_t)w * 4 * out_h), *row = malloc((size_t)out_w * 4);
    int y, result = -1;
    if (temp != NULL && row != NULL) {
        for (y = 0; y < out_h; y++) {
            gf_vertical_row(src, (long)w * 4, temp + (size_t)y * w * 4, w * 4, down, y);
        }
        for (y = 0; y < out_h; y++) {
            gf_horizontal_row(temp + (size_t)y * w * 4, row, out_w, across);
            gf_store_row(t, row, out_w, y);
        }
        result = 0;
    }
    free(temp);
    free(row);
    return result;
}

/* Horizontal pass into temp (rows x out_w RGBX), mirrored when `flip` on the vector path. */
static int gf_horizontal_pass(const unsigned char *src, int w, int first_row, int rows, unsigned char *temp,
                              unsigned char *scratch, int out_w, const struct gf_axis *across, int simd, int flip) {
    long stride = (long)out_w * 4;
    int y;
#ifdef GF_X86
    if (simd) {
        int32_t *pairs = gf_pairs(across, out_w);
        if (pairs == NULL) {
            return -1;
        }
        for (y = 0; y < rows; y += 4) {
            const unsigned char *in[4];
            unsigned char *out[4];
            int r;
            for (r = 0; r < 4; r++) { /* past the last row: repeat it into the scratch row */
                int yr = y + r < rows ? y + r : rows - 1;
                in[r] = src + (size_t)(first_row + yr) * w * 4;
                out[r] = y + r < rows ? temp + (size_t)(y + r) * stride : scratch;
            }
            gf_horizontal4_avx2(in, out, w, out_w, across, pairs, flip);
        }
        free(pairs);
        return 0;
    }
#else
    (void)simd;
    (void)scratch;
    (void)flip;
#endif
    for (y = 0; y < rows; y++) {
        gf_horizontal_row(src + (size_t)(first_row + y) * w * 4, temp + (size_t)y * stride, out_w, across);
    }
    return 0;
}

/*
 * box (x0, y0, x1, y1) of the RGBX image src (w x h, rows packed) -> out_w x
 * out_h, bilinear as PIL computes it in `mode`, each finished row stored into
 * `t`. Returns 0, or -1 when out of memory.
 */
static int gf_resize_into(const unsigned char *src, int w, int h, const double *box, int out_w, int out_h, int mode,
                          int filter, const struct gf_target *t, int allow_simd) {
    struct gf_axis across = {0}, down = {0};
    struct gf_target unflipped = *t;
    unsigned char *temp = NULL, *row = NULL;
    int result = -1, first_row, rows, y, simd = 0, direct = 0;
    long stride = (long)out_w * 4;

    if (box[0] == floor(box[0]) && box[1] == floor(box[1]) && box[2] - box[0] == out_w && box[3] - box[1] == out_h &&
        box[0] >= 0 && box[1] >= 0 && box[2] <= w && box[3] <= h) { /* an exact crop: PIL copies, so do we */
        for (y = 0; y < out_h; y++) {
            gf_store_row(t, src + ((size_t)((int)box[1] + y) * w + (int)box[0]) * 4, out_w, y);
        }
        gf_store_done(t);
        return 0;
    }
    if (gf_axis_make(&across, w, box[0], box[2], out_w, mode, filter) != 0 ||
        gf_axis_make(&down, h, box[1], box[3], out_h, mode, filter) != 0) {
        goto done;
    }
    if (mode == GF_PILLOW && h - out_h > 0 && h - out_h > (w - out_w) * 2) {
        result = gf_vertical_first(src, w, &across, &down, out_w, out_h, t);
        goto finish;
    }
    first_row = down.first[0];
    rows = down.first[out_h - 1] + down.count[out_h - 1] - first_row;
    for (y = 0; y < out_h; y++) {
        down.first[y] -= first_row;
    }
#ifdef GF_X86
    simd = allow_simd && mode == GF_PILLOW_SIMD && gf_has_avx2();
    direct = simd && t->stride_x == 1;
#else
    (void)allow_simd;
    (void)direct;
#endif
    temp = malloc((size_t)stride * (rows > 0 ? rows : 1));
    row = malloc((size_t)stride + 32);
    if (temp == NULL || row == NULL ||
        gf_horizontal_pass(src, w, first_row, rows, temp, row, out_w, &across, simd, t->flip) != 0) {
        goto done;
    }
    if (simd) {
        unflipped.flip = 0; /* the horizontal pass mirrored the rows */
    }
    for (y = 0; y < out_h; y++) {
        int stored = 0;
#ifdef GF_X86
        if (simd) {
            stored = gf_vertical_avx2(temp, stride, row, out_w, &down, y, &unflipped, direct);
        } else
#endif
        {
            gf_vertical_row(temp, stride, row, out_w * 4, &down, y);
        }
        gf_store_tail(&unflipped, row, out_w, y, stored);
    }
    result = 0;
finish:
    gf_store_done(t);
done:
    free(temp);
    free(row);
    gf_axis_free(&across);
    gf_axis_free(&down);
    return result;
}

/*
 * One image, with any of the three filters: the loader's decoded regions (bilinear) and prepare's RGB path
 * (its resize filter). Tests compare it with PIL; allow_simd 0 forces the scalar kernels.
 */
int gf_resize_store(const unsigned char *src, int w, int h, const double *box, int out_w, int out_h, int mode,
                    int filter, int flip, void *out, long stride_c, long stride_y, long stride_x, const float *scale,
                    const float *shift, int allow_simd) {
    struct gf_target t = {out, stride_c, stride_y, stride_x, flip, scale, shift};
    if (filter != GF_BILINEAR && filter != GF_BICUBIC && filter != GF_LANCZOS) {
        return -1;
    }
    return gf_resize_into(src, w, h, box, out_w, out_h, mode, filter, &t, allow_simd);
}

/* ------------------------------------------------------------------------ */
/* One 8-bit plane (prepare's YCbCr path, ycc.c)                            */
/*
 * Pillow-SIMD resizes 8-bit planes ("L") with scalar code, about 3.5 times
 * slower per pixel than RGBX. Here both passes run down columns, where every
 * output row is a weighted sum of whole input rows and the compiler
 * vectorises the inner loop: the vertical pass directly, the horizontal one
 * between two transposes. Weights are Pillow-SIMD's (16-bit), and the
 * intermediate rows are rounded to 8 bits between the passes, as in Pillow.
 */

/* out row yy = the weighted sum of in rows a->first[yy] .. + a->count[yy], `bytes` columns. */
static inline __attribute__((always_inline)) void gf_rows_body(const unsigned char *in, long in_stride,
                                                               unsigned char *out, long out_stride, int bytes,
                                                               int out_rows, const struct gf_axis *a, int32_t *acc) {
    const int32_t half = 1 << (a->precision - 1);
    for (int yy = 0; yy < out_rows; yy++) {
        const int32_t *k = a->k + (size_t)yy * a->ksize;
        const unsigned char *rows = in + (size_t)a->first[yy] * in_stride;
        unsigned char *target = out + (size_t)yy * out_stride;
        for (int x = 0; x < bytes; x++) {
            acc[x] = half;
        }
        for (int t = 0; t < a->count[yy]; t++) {
            const unsigned char *row = rows + (size_t)t * in_stride;
            const int32_t weight = k[t];
            for (int x = 0; x < bytes; x++) {
                acc[x] += row[x] * weight;
            }
        }
        for (int x = 0; x < bytes; x++) {
            int32_t v = acc[x] >> a->precision;
            target[x] = (unsigned char)(v < 0 ? 0 : (v > 255 ? 255 : v));
        }
    }
}

static void gf_rows_plain(const unsigned char *in, long in_stride, unsigned char *out, long out_stride, int bytes,
                          int out_rows, const struct gf_axis *a, int32_t *acc) {
    gf_rows_body(in, in_stride, out, out_stride, bytes, out_rows, a, acc);
}

#ifdef GF_X86
/*
 * The same, 32 columns at a time in registers: two input rows' bytes are
 * interleaved as 16-bit pairs and multiplied by the two rows' weights in one
 * vpmaddwd (exact in 32 bits). The unpacks work within 128-bit lanes and the
 * packs undo their order, so the 32 bytes come out in place.
 */
__attribute__((target("avx2"))) static void gf_rows_avx2(const unsigned char *in, long in_stride, unsigned char *out,
                                                        long out_stride, int bytes, int out_rows,
                                                        const struct gf_axis *a, int32_t *acc) {
    const __m256i zero = _mm256_setzero_si256();
    const int32_t half = 1 << (a->precision - 1);
    for (int yy = 0; yy < out_rows; yy++) {
        const int32_t *k = a->k + (size_t)yy * a->ksize;
        const unsigned char *rows = in + (size_t)a->first[yy] * in_stride;
        unsigned char *target = out + (size_t)yy * out_stride;
        const int count = a->count[yy];
        int x = 0;
        for (; x + 32 <= bytes; x += 32) {
            __m256i s0 = _mm256_set1_epi32(half), s1 = s0, s2 = s0, s3 = s0;
            for (int t = 0; t < count; t += 2) {
                const __m256i p = _mm256_loadu_si256((const __m256i *)(rows + (size_t)t * in_stride + x));
                __m256i q = zero;
                uint32_t pair = (uint16_t)k[t];
                if (t + 1 < count) {
                    q = _mm256_loadu_si256((const __m256i *)(rows + (size_t)(t + 1) * in_stride + x));
                    pair |= (uint32_t)(uint16_t)k[t + 1] << 16;
                }
                const __m256i w = _mm256_set1_epi32((int32_t)pair);
                const __m256i p_lo = _mm256_unpacklo_epi8(p, zero), p_hi = _mm256_unpackhi_epi8(p, zero);
                const __m256i q_lo = _mm256_unpacklo_epi8(q, zero), q_hi = _mm256_unpackhi_epi8(q, zero);
                s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_unpacklo_epi16(p_lo, q_lo), w));
                s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_unpackhi_epi16(p_lo, q_lo), w));
                s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(_mm256_unpacklo_epi16(p_hi, q_hi), w));
                s3 = _mm256_add_epi32(s3, _mm256_madd_epi16(_mm256_unpackhi_epi16(p_hi, q_hi), w));
            }
            const __m128i shift = _mm_cvtsi32_si128(a->precision);
            s0 = _mm256_sra_epi32(s0, shift);
            s1 = _mm256_sra_epi32(s1, shift);
            s2 = _mm256_sra_epi32(s2, shift);
            s3 = _mm256_sra_epi32(s3, shift);
            const __m256i packed = _mm256_packus_epi16(_mm256_packs_epi32(s0, s1), _mm256_packs_epi32(s2, s3));
            _mm256_storeu_si256((__m256i *)(target + x), packed);
        }
        for (; x < bytes; x++) {
            int32_t sum = half;
            for (int t = 0; t < count; t++) {
                sum += rows[(size_t)t * in_stride + x] * k[t];
            }
            target[x] = gf_clip8(sum, a->precision);
        }
    }
    (void)acc;
}
#endif

static void gf_rows(const unsigned char *in, long in_stride, unsigned char *out, long out_stride, int bytes,
                    int out_rows, const struct gf_axis *a, int32_t *acc, int allow_simd) {
#ifdef GF_X86
    if (allow_simd && gf_has_avx2()) {
        gf_rows_avx2(in, in_stride, out, out_stride, bytes, out_rows, a, acc);
        return;
    }
#else
    (void)allow_simd;
#endif
    gf_rows_plain(in, in_stride, out, out_stride, bytes, out_rows, a, acc);
}

#if defined(GF_X86) || defined(__SSE2__)
/* One 16 x 16 tile, four rounds of interleaving (SSE2, in every x86-64). */
static void gf_transpose_tile(const unsigned char *in, long in_stride, unsigned char *out, long out_stride) {
    __m128i a[16], b[16];
    for (int i = 0; i < 16; i++) {
        a[i] = _mm_loadu_si128((const __m128i *)(in + (size_t)i * in_stride));
    }
    for (int round = 0; round < 4; round++) { /* rows i and i + 8 interleaved, four times: a transpose */
        __m128i *from = round % 2 ? b : a, *to = round % 2 ? a : b;
        for (int i = 0; i < 8; i++) {
            to[2 * i] = _mm_unpacklo_epi8(from[i], from[i + 8]);
            to[2 * i + 1] = _mm_unpackhi_epi8(from[i], from[i + 8]);
        }
    }
    for (int i = 0; i < 16; i++) {
        _mm_storeu_si128((__m128i *)(out + (size_t)i * out_stride), a[i]);
    }
}
#endif

/* out (w rows of h) = in (h rows of w) transposed, in 16 x 16 tiles. */
static void gf_transpose(const unsigned char *in, long in_stride, int w, int h, unsigned char *out, long out_stride) {
    for (int y0 = 0; y0 < h; y0 += 16) {
        int y1 = y0 + 16 < h ? y0 + 16 : h;
        for (int x0 = 0; x0 < w; x0 += 16) {
            int x1 = x0 + 16 < w ? x0 + 16 : w;
#if defined(GF_X86) || defined(__SSE2__)
            if (y1 - y0 == 16 && x1 - x0 == 16) {
                gf_transpose_tile(in + (size_t)y0 * in_stride + x0, in_stride, out + (size_t)x0 * out_stride + y0,
                                  out_stride);
                continue;
            }
#endif
            for (int x = x0; x < x1; x++) {
                unsigned char *target = out + (size_t)x * out_stride;
                for (int y = y0; y < y1; y++) {
                    target[y] = in[(size_t)y * in_stride + x];
                }
            }
        }
    }
}

/*
 * box (x0, y0, x1, y1) of the 8-bit plane src (w x h) -> out (out_w x
 * out_h) with `filter` (GF_BILINEAR, GF_BICUBIC, GF_LANCZOS); the box may
 * reach past the plane, whose edge pixels then weigh more, as in Pillow.
 * Returns 0, or -1 when out of memory or the sizes are not positive.
 */
int gf_plane_resize(const unsigned char *src, long src_stride, int w, int h, const double *box, unsigned char *out,
                    long out_stride, int out_w, int out_h, int filter, int allow_simd) {
    struct gf_axis across = {0}, down = {0};
    unsigned char *rows = NULL, *columns = NULL, *resized = NULL;
    int32_t *acc = NULL;
    int result = -1;

    if (w < 1 || h < 1 || out_w < 1 || out_h < 1) {
        return -1;
    }
    if (box[0] == floor(box[0]) && box[1] == floor(box[1]) && box[2] - box[0] == out_w && box[3] - box[1] == out_h &&
        box[0] >= 0 && box[1] >= 0 && box[2] <= w && box[3] <= h) { /* an exact crop: copy, as Pillow does */
        for (int y = 0; y < out_h; y++) {
            memcpy(out + (size_t)y * out_stride, src + (size_t)((int)box[1] + y) * src_stride + (int)box[0],
                   (size_t)out_w);
        }
        return 0;
    }
    if (gf_axis_make(&across, w, (float)box[0], (float)box[2], out_w, GF_PILLOW_SIMD, filter) != 0 ||
        gf_axis_make(&down, h, (float)box[1], (float)box[3], out_h, GF_PILLOW_SIMD, filter) != 0) {
        goto done;
    }
    /* Only the columns the horizontal pass reads go through the vertical one. */
    int left = w, right = 0;
    for (int x = 0; x < out_w; x++) {
        if (across.count[x] > 0) {
            left = across.first[x] < left ? across.first[x] : left;
            right = across.first[x] + across.count[x] > right ? across.first[x] + across.count[x] : right;
        }
    }
    if (right <= left) {
        left = 0;
        right = 1;
    }
    for (int x = 0; x < out_w; x++) {
        across.first[x] = across.count[x] > 0 ? across.first[x] - left : 0;
    }
    int span = right - left, longest = span > out_w ? span : out_w;
    rows = malloc((size_t)out_h * span);
    columns = malloc((size_t)span * out_h);
    resized = malloc((size_t)out_w * out_h);
    acc = malloc(sizeof(int32_t) * (size_t)(longest > out_h ? longest : out_h));
    if (rows == NULL || columns == NULL || resized == NULL || acc == NULL) {
        goto done;
    }
    gf_rows(src + left, src_stride, rows, span, span, out_h, &down, acc, allow_simd);
    gf_transpose(rows, span, span, out_h, columns, out_h);
    gf_rows(columns, out_h, resized, out_h, out_h, out_w, &across, acc, allow_simd);
    gf_transpose(resized, out_h, out_h, out_w, out, out_stride);
    result = 0;
done:
    free(rows);
    free(columns);
    free(resized);
    free(acc);
    gf_axis_free(&across);
    gf_axis_free(&down);
    return result;
}

/*
 * The w x h plane src turned upright for EXIF orientation 1..8, into out
 * (h x w for 5..8), as Pillow's transpose methods do: 2 mirror, 3 rotate
 * 180, 4 flip, 5 transpose, 6 rotate 90 clockwise, 7 transverse, 8 rotate
 * 90 counter-clockwise. Returns 0, or -1 when out of memory.
 */
int gf_plane_orient(const unsigned char *src, long src_stride, int w, int h, int orientation, unsigned char *out,
                    long out_stride) {
    const unsigned char *from = src;
    unsigned char *turned = NULL;
    long from_stride = src_stride;
    int ow = w, oh = h;
    if (orientation >= 5 && orientation <= 8) {
        turned = malloc((size_t)w * h);
        if (turned == NULL) {
            return -1;
        }
        gf_transpose(src, src_stride, w, h, turned, h);
        from = turned;
        from_stride = h;
        ow = h;
        oh = w;
    }
    /* After the transpose: 6 mirrors, 7 mirrors and flips, 8 flips. */
    int mirror = orientation == 2 || orientation == 3 || orientation == 6 || orientation == 7;
    int flip = orientation == 3 || orientation == 4 || orientation == 7 || orientation == 8;
    for (int y = 0; y < oh; y++) {
        const unsigned char *row = from + (size_t)(flip ? oh - 1 - y : y) * from_stride;
        unsigned char *target = out + (size_t)y * out_stride;
        if (mirror) {
            for (int x = 0; x < ow; x++) {
                target[x] = row[ow - 1 - x];
            }
        } else {
            memcpy(target, row, (size_t)ow);
        }
    }
    free(turned);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Crop plans: where each sample's crop lies and what region to decode      */

/*
 * The crop's random numbers: splitmix64 seeded with the sample's seed.
 * crops.CropRandom is the same generator in Python (for the decoders that
 * run there), so every decoder picks the same crop for the same seed.
 */
static uint64_t gf_next(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static double gf_uniform(uint64_t *state, double a, double b) {
    return a + (b - a) * ((double)(gf_next(state) >> 11) * (1.0 / 9007199254740992.0));
}

static long gf_randint(uint64_t *state, long a, long b) { /* a..b inclusive */
    return a + (long)(gf_next(state) % (uint64_t)(b - a + 1));
}

/* What the crop spec says, the same for every image of a call. */
struct gf_crop_spec {
    int train, out_w, out_h, size; /* output width, height; the spec's size (the eval crop's side) */
    double scale_lo, scale_hi, log_ratio_lo, log_ratio_hi, ratio_lo, ratio_hi, eval_fraction;
};

/* (left, top, width, height) like torchvision's RandomResizedCrop.get_params; crops.random_resized_crop_box. */
static void gf_random_crop(uint64_t seed, int width, int height, const struct gf_crop_spec *s, double *crop) {
    uint64_t state = seed;
    double area = (double)width * height, in_ratio;
    long w, h;
    int attempt;
    for (attempt = 0; attempt < 10; attempt++) {
        double target = area * gf_uniform(&state, s->scale_lo, s->scale_hi);
        double aspect = exp(gf_uniform(&state, s->log_ratio_lo, s->log_ratio_hi));
        w = (long)nearbyint(sqrt(target * aspect));
        h = (long)nearbyint(sqrt(target / aspect));
        if (0 < w && w <= width && 0 < h && h <= height) {
            crop[0] = (double)gf_randint(&state, 0, width - w);
            crop[1] = (double)gf_randint(&state, 0, height - h);
            crop[2] = (double)w;
            crop[3] = (double)h;
            return;
        }
    }
    in_ratio = (double)width / height;
    if (in_ratio < s->ratio_lo) {
        w = width;
        h = (long)nearbyint(width / s->ratio_lo);
    } else if (in_ratio > s->ratio_hi) {
        h = height;
        w = (long)nearbyint(height * s->ratio_hi);
    } else {
        w = width;
        h = height;
    }
    crop[0] = (double)((width - w) / 2);
    crop[1] = (double)((height - h) / 2);
    crop[2] = (double)w;
    crop[3] = (double)h;
}

/*
 * transforms.v2's Resize(out / eval_fraction) then CenterCrop(out) as one box (crops.centre_crop_box): the
 * shorter side resized to exactly that, the longer truncated, the crop's anchor rounded half to even (as
 * Python's round), mapped back by each axis's scale.
 */
static void gf_centre_crop(int width, int height, const struct gf_crop_spec *s, double *crop) {
    double resized_short = nearbyint(s->size / s->eval_fraction);
    double new_w, new_h, sx, sy;
    if (width <= height) {
        new_w = resized_short;
        new_h = floor(resized_short * height / width);
    } else {
        new_w = floor(resized_short * width / height);
        new_h = resized_short;
    }
    sx = width / new_w;
    sy = height / new_h;
    crop[0] = nearbyint((new_w - s->size) / 2.0) * sx;
    crop[1] = nearbyint((new_h - s->size) / 2.0) * sy;
    crop[2] = s->size * sx;
    crop[3] = s->size * sy;
}

/*
 * One image's plan (crops.region_plan): the crop box in the image scaled by
 * the smallest M/8 that keeps the crop at least the output size, and the
 * region of that scaled image to decode (the box plus the margin the
 * resampling filter reads). params: scale_num, x, y, w, h; box: x0, y0, x1,
 * y1; returns the RGBX bytes the region needs.
 */
static unsigned long gf_plan(int width, int height, uint64_t seed, const struct gf_crop_spec *s, int *params,
                             double *box) {
    double crop[4], sx, sy;
    long scaled_w, scaled_h, x0, y0, x1, y1, eighths, margin;
    if (s->train) {
        gf_random_crop(seed, width, height, s, crop);
    } else {
        gf_centre_crop(width, height, s, crop);
    }
    {
        double need = s->out_w / crop[2] > s->out_h / crop[3] ? s->out_w / crop[2] : s->out_h / crop[3];
        eighths = (long)ceil(8 * need - 1e-9);
        eighths = eighths < 1 ? 1 : (eighths > 8 ? 8 : eighths);
    }
    scaled_w = (width * eighths + 7) / 8;
    scaled_h = (height * eighths + 7) / 8;
    sx = sy = eighths / 8.0; /* the scaled IDCT maps x to x * M/8 exactly; only the size is rounded up */
    box[0] = crop[0] * sx;
    box[1] = crop[1] * sy;
    box[2] = (crop[0] + crop[2]) * sx;
    box[3] = (crop[1] + crop[3]) * sy;
    {
        double across = (box[2] - box[0]) / s->out_w, down = (box[3] - box[1]) / s->out_h;
        margin = 3 + (long)ceil(across > down ? across : down);
    }
    x0 = (long)floor(box[0]) - margin;
    y0 = (long)floor(box[1]) - margin;
    x1 = (long)ceil(box[2]) + margin;
    y1 = (long)ceil(box[3]) + margin;
    x0 = x0 < 0 ? 0 : x0;
    y0 = y0 < 0 ? 0 : y0;
    x1 = x1 > scaled_w ? scaled_w : x1;
    y1 = y1 > scaled_h ? scaled_h : y1;
    params[0] = (int)eighths;
    params[1] = (int)x0;
    params[2] = (int)y0;
    params[3] = (int)(x1 - x0);
    params[4] = (int)(y1 - y0);
    return (unsigned long)(scaled_w * (y1 - y0) * 4);
}

/*
 * Plans for many images (info: width, height per image, as gf_header_many
 * gives; shape: train, out_w, out_h, size; spec: scale lo/hi, log-ratio
 * lo/hi, ratio lo/hi, eval_fraction). Images whose status is not 0 are
 * skipped.
 */
void gf_plan_many(int n, const int *info, const int *status, const uint64_t *seeds, const int *shape,
                  const double *spec, int *params, double *boxes, unsigned long *sizes) {
    struct gf_crop_spec s = {shape[0], shape[1], shape[2], shape[3], spec[0], spec[1], spec[2],
                             spec[3], spec[4], spec[5], spec[6]};
    int i;
    for (i = 0; i < n; i++) {
        sizes[i] = 0;
        if (status[i] == 0) {
            sizes[i] = gf_plan(info[4 * i], info[4 * i + 1], seeds[i], &s, params + 5 * i, boxes + 4 * i);
        }
    }
}

/*
 * The loader's whole per-sample work for a batch piece in one call, so the
 * decode thread takes Python's lock back once per piece: for each JPEG, its
 * header, the pixel limits (max_pixels), the crop plan (gf_plan_many's
 * shape and spec, seeds[i]), the region decode and the resize into its
 * target. status[i]: 0 done, -1 libjpeg refused it (message),
 * GF_UNSUPPORTED (CMYK), GF_OUT_OF_MEMORY, GF_OVER_LIMITS (over the pixel
 * limits or empty: Python says which).
 */
void gf_crop_many(int n, const unsigned char *const *data, const unsigned long *sizes, const uint64_t *seeds,
                  const int *shape, const double *spec, double max_pixels, void *const *targets,
                  const unsigned char *flips, int mode, long stride_c, long stride_y, long stride_x, const float *scale,
                  const float *shift, int *status, char *messages, int message_size) {
    struct gf_crop_spec s = {shape[0], shape[1], shape[2], shape[3], spec[0], spec[1], spec[2],
                             spec[3], spec[4], spec[5], spec[6]};
    unsigned char *buffer = NULL;
    unsigned long capacity = 0;
    int i;
    for (i = 0; i < n; i++) {
        char *message = messages + (long)i * message_size;
        struct gf_target t = {targets[i], stride_c, stride_y, stride_x, flips[i], scale, shift};
        int info[4], params[5], decoded[2];
        double box[4];
        unsigned long needed;
        status[i] = gf_header(data[i], sizes[i], info, message, message_size);
        if (status[i] != 0) {
            continue;
        }
        if (info[0] < 1 || info[1] < 1 || (double)info[0] * info[1] > max_pixels) {
            status[i] = GF_OVER_LIMITS;
            continue;
        }
        needed = gf_plan(info[0], info[1], seeds[i], &s, params, box);
        if (needed > capacity) {
            unsigned char *grown = realloc(buffer, needed + 64);
            if (grown == NULL) {
                status[i] = GF_OUT_OF_MEMORY;
                continue;
            }
            buffer = grown;
            capacity = needed;
        }
        status[i] = gf_decode_region(data[i], sizes[i], params[0], params[1], params[2], params[3], params[4], buffer,
                                     capacity, decoded, message, message_size);
        if (status[i] != 0) {
            continue;
        }
        box[0] -= decoded[0];
        box[1] -= params[2];
        box[2] -= decoded[0];
        box[3] -= params[2];
        if (gf_resize_into(buffer, decoded[1], params[4], box, s.out_w, s.out_h, mode, GF_BILINEAR, &t, 1) != 0) {
            status[i] = GF_OUT_OF_MEMORY;
        }
    }
    free(buffer);
}
