/*
 * Photometric augmentation on uint8 planar RGB (a loader's CHW slot): ultralytics' HSV gains.
 *
 * gf_hsv converts each pixel to OpenCV's 8-bit HSV in its fixed point (hue in degrees / 2,
 * 12-bit reciprocal tables rounded half to even), sends H, S and V through the three lookup
 * tables the caller built (ultralytics' gains, truncated to 8 bits), and converts back as
 * OpenCV's vector path does (floats, truncated). pipeline/augment/hsv.py holds the same
 * arithmetic in torch for batches on a GPU; tests/augment compare both with ultralytics.
 *
 * Where the CPU has AVX2 (checked at run time; the library is built without -m flags), eight
 * pixels go at once: the same integer steps, the tables through gathers, the same float
 * expressions in the same order (no FMA), so its output equals the scalar loop's bit for bit
 * (tests/native compare them); allow_simd 0 forces the scalar loop.
 */

#include <math.h>

#include "gpufeed.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(GF_NO_SIMD) /* as resample.c */
#include <immintrin.h>
#define GF_HSV_X86 1
#endif

/* Per call: OpenCV's reciprocal tables, and the lookup tables composed with what the conversion back starts
 * from (computed once per value by the scalar expressions, so each pixel pays loads and multiplies only). */
struct gf_hsv_tables {
    int sdiv[256], hdiv[256], sector[256];
    float frac[256], sat[256], val[256];
};

static void gf_hsv_tables(struct gf_hsv_tables *t, const unsigned char *lut_h, const unsigned char *lut_s,
                          const unsigned char *lut_v) {
    float unit[256], frac_of[256];
    int sector_of[256];
    t->sdiv[0] = t->hdiv[0] = 0;
    for (int i = 1; i < 256; i++) {
        t->sdiv[i] = (int)nearbyint((double)(255 << 12) / i);
        t->hdiv[i] = (int)nearbyint((double)(180 << 12) / (6.0 * i));
    }
    for (int i = 0; i < 256; i++) {
        unit[i] = (float)i / 255.0f;
        float hue = (float)(i * 2) / 60.0f;
        int sector = (int)hue; /* truncation is the floor here: everything is >= 0 */
        frac_of[i] = hue - (float)sector;
        sector_of[i] = sector % 6;
    }
    for (int i = 0; i < 256; i++) {
        t->sector[i] = sector_of[lut_h[i]];
        t->frac[i] = frac_of[lut_h[i]];
        t->sat[i] = unit[lut_s[i]];
        t->val[i] = unit[lut_v[i]];
    }
}

static inline unsigned char gf_clamp8(int x) { return (unsigned char)(x < 0 ? 0 : (x > 255 ? 255 : x)); }

/* Which of (v, p, q, t) each channel takes in each of the six hue sectors (OpenCV's HSV2RGB). */
static const unsigned char gf_pick_r[6] = {0, 2, 1, 1, 3, 0}, gf_pick_g[6] = {3, 0, 0, 2, 1, 1},
                           gf_pick_b[6] = {1, 1, 3, 0, 0, 2};

static void gf_hsv_scalar(const struct gf_hsv_tables *t, unsigned char *r, unsigned char *g, unsigned char *b,
                          long start, long count) {
    for (long i = start; i < count; i++) {
        int red = r[i], green = g[i], blue = b[i];
        int v = red > green ? red : green;
        v = v > blue ? v : blue;
        int low = red < green ? red : green;
        low = low < blue ? low : blue;
        int diff = v - low;
        int s = (diff * t->sdiv[v] + 2048) >> 12;
        int raw = v == red ? green - blue : (v == green ? blue - red + 2 * diff : red - green + 4 * diff);
        int h = (raw * t->hdiv[diff] + 2048) >> 12;
        h += h < 0 ? 180 : 0;
        int sector = t->sector[h];
        float frac = t->frac[h], sv = t->sat[s], vv = t->val[v];
        float values[4] = {vv, vv * (1.0f - sv), vv * (1.0f - sv * frac), vv * (1.0f - sv * (1.0f - frac))};
        r[i] = gf_clamp8((int)(values[gf_pick_r[sector]] * 255.0f + 1e-4f));
        g[i] = gf_clamp8((int)(values[gf_pick_g[sector]] * 255.0f + 1e-4f));
        b[i] = gf_clamp8((int)(values[gf_pick_b[sector]] * 255.0f + 1e-4f));
    }
}

#ifdef GF_HSV_X86
__attribute__((target("avx2"))) static inline __m256i gf_load8(const unsigned char *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

__attribute__((target("avx2"))) static inline void gf_store8(unsigned char *p, __m256 value) {
    __m256i x = _mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(value, _mm256_set1_ps(255.0f)), _mm256_set1_ps(1e-4f)));
    __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)); /* clamps at 0 */
    _mm_storel_epi64((__m128i *)p, _mm_packus_epi16(words, words));                               /* and at 255 */
}

__attribute__((target("avx2"))) static inline __m256 gf_pick(__m256 base, __m256 value, __m256i sector, int a, int b) {
    __m256i hit = _mm256_or_si256(_mm256_cmpeq_epi32(sector, _mm256_set1_epi32(a)),
                                  _mm256_cmpeq_epi32(sector, _mm256_set1_epi32(b)));
    return _mm256_blendv_ps(base, value, _mm256_castsi256_ps(hit));
}

__attribute__((target("avx2"))) static long gf_hsv_avx2(const struct gf_hsv_tables *t, unsigned char *r,
                                                       unsigned char *g, unsigned char *b, long count) {
    const __m256i round = _mm256_set1_epi32(2048), zero = _mm256_setzero_si256(), wrap = _mm256_set1_epi32(180);
    const __m256 one = _mm256_set1_ps(1.0f);
    long i = 0;
    for (; i + 8 <= count; i += 8) {
        __m256i red = gf_load8(r + i), green = gf_load8(g + i), blue = gf_load8(b + i);
        __m256i v = _mm256_max_epi32(_mm256_max_epi32(red, green), blue);
        __m256i diff = _mm256_sub_epi32(v, _mm256_min_epi32(_mm256_min_epi32(red, green), blue));
        __m256i s = _mm256_srai_epi32(
            _mm256_add_epi32(_mm256_mullo_epi32(diff, _mm256_i32gather_epi32(t->sdiv, v, 4)), round), 12);
        __m256i from_red = _mm256_sub_epi32(green, blue);
        __m256i from_green = _mm256_add_epi32(_mm256_sub_epi32(blue, red), _mm256_slli_epi32(diff, 1));
        __m256i from_blue = _mm256_add_epi32(_mm256_sub_epi32(red, green), _mm256_slli_epi32(diff, 2));
        __m256i raw = _mm256_blendv_epi8(from_blue, from_green, _mm256_cmpeq_epi32(v, green));
        raw = _mm256_blendv_epi8(raw, from_red, _mm256_cmpeq_epi32(v, red)); /* red first, as the scalar test */
        __m256i h = _mm256_srai_epi32(
            _mm256_add_epi32(_mm256_mullo_epi32(raw, _mm256_i32gather_epi32(t->hdiv, diff, 4)), round), 12);
        h = _mm256_add_epi32(h, _mm256_and_si256(_mm256_cmpgt_epi32(zero, h), wrap));
        __m256i sector = _mm256_i32gather_epi32(t->sector, h, 4);
        __m256 frac = _mm256_i32gather_ps(t->frac, h, 4), sv = _mm256_i32gather_ps(t->sat, s, 4);
        __m256 vv = _mm256_i32gather_ps(t->val, v, 4);
        __m256 p = _mm256_mul_ps(vv, _mm256_sub_ps(one, sv));
        __m256 q = _mm256_mul_ps(vv, _mm256_sub_ps(one, _mm256_mul_ps(sv, frac)));
        __m256 tt = _mm256_mul_ps(vv, _mm256_sub_ps(one, _mm256_mul_ps(sv, _mm256_sub_ps(one, frac))));
        /* sectors 0-5: red v q p p t v, green t v v q p p, blue p p t v v q */
        __m256 out_r = gf_pick(gf_pick(gf_pick(vv, q, sector, 1, 1), p, sector, 2, 3), tt, sector, 4, 4);
        __m256 out_g = gf_pick(gf_pick(gf_pick(p, tt, sector, 0, 0), vv, sector, 1, 2), q, sector, 3, 3);
        __m256 out_b = gf_pick(gf_pick(gf_pick(vv, p, sector, 0, 1), tt, sector, 2, 2), q, sector, 5, 5);
        gf_store8(r + i, out_r);
        gf_store8(g + i, out_g);
        gf_store8(b + i, out_b);
    }
    return i;
}
#endif

void gf_hsv(unsigned char *pixels, long plane, long count, const unsigned char *lut_h, const unsigned char *lut_s,
            const unsigned char *lut_v, int allow_simd) {
    struct gf_hsv_tables tables;
    gf_hsv_tables(&tables, lut_h, lut_s, lut_v);
    unsigned char *r = pixels, *g = pixels + plane, *b = pixels + 2 * plane;
    long done = 0;
#ifdef GF_HSV_X86
    if (allow_simd && gf_has_avx2()) done = gf_hsv_avx2(&tables, r, g, b, count);
#else
    (void)allow_simd;
#endif
    gf_hsv_scalar(&tables, r, g, b, done, count);
}
