/*
 * Photometric augmentation on uint8 planar RGB (a loader's CHW slot): ultralytics' HSV gains.
 *
 * gf_hsv converts each pixel to OpenCV's 8-bit HSV in its fixed point (hue in degrees / 2,
 * 12-bit reciprocals of V and of 6 (max - min), rounded half to even), sends H, S and V through
 * the three lookup tables the caller built (ultralytics' gains, truncated to 8 bits), and converts
 * back as OpenCV's vector path does (floats, truncated), with its two divisions (by 60 and by 255)
 * as products by the reciprocal: a level apart from OpenCV's at most, on a few colours.
 * pipeline/augment/hsv.py holds OpenCV's own arithmetic in torch for batches on a GPU; tests/augment
 * compare both with ultralytics.
 *
 * Where the CPU has AVX2 (checked at run time; the library is built without -m flags), eight
 * pixels go at once, sixteen with AVX-512 (F and BW; a third faster again): the same integer steps
 * and the same float expressions in the same order (no FMA), so their output equals the scalar
 * loop's bit for bit (tests/native compare each with it on every colour). It computes what the tables hold instead of reading them (eight-way gathers cost more
 * than the rest of the pixel): the reciprocals as float quotients rounded to nearest (equal to
 * OpenCV's tables on every value), the hue table as a shift mod 180, the saturation and value
 * tables as a fixed-point product where it gives every entry, else as the double product the table
 * was built from (`gains`, its multipliers), truncated. Each call checks its tables against those
 * formulas; where one differs (a hue gain a hair below a whole step puts 180 in its table), the
 * scalar loop runs. allow_simd 0 forces the scalar loop, 1 the AVX2 one.
 */

#include <math.h>

#include "gpufeed.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(GF_NO_SIMD) /* as resample.c */
#include <immintrin.h>
#define GF_HSV_X86 1
#endif

#define GF_SDIV_TOP ((float)(255 << 12))      /* OpenCV's sdiv[v] = round((255 << 12) / v) */
#define GF_HDIV_TOP ((float)((180 << 12) / 6)) /* hdiv[d] = round((180 << 12) / (6 d)) */
static const float gf_sixtieth = 1.0f / 60.0f, gf_unit = 1.0f / 255.0f;

static inline unsigned char gf_clamp8(int x) { return (unsigned char)(x < 0 ? 0 : (x > 255 ? 255 : x)); }

/* Which of (v, p, q, t) each channel takes in each of the six hue sectors (OpenCV's HSV2RGB). */
static const unsigned char gf_pick_r[6] = {0, 2, 1, 1, 3, 0}, gf_pick_g[6] = {3, 0, 0, 2, 1, 1},
                           gf_pick_b[6] = {1, 1, 3, 0, 0, 2};

/* OpenCV's reciprocal tables, sdiv[v] = round((255 << 12) / v) and hdiv[d] = round((180 << 12) / (6 d)), 0 at 0,
 * built once; `quotients`: whether the float quotients rounded give every entry (what the vector loops compute). */
static int gf_sdiv[256], gf_hdiv[256], gf_quotients, gf_reciprocals_built;

static void gf_reciprocals(void) {
    if (__atomic_load_n(&gf_reciprocals_built, __ATOMIC_ACQUIRE)) return;
    int quotients = 1;
    for (int i = 1; i < 256; i++) { /* the same values whichever thread writes them first */
        gf_sdiv[i] = (int)nearbyint((double)(255 << 12) / i);
        gf_hdiv[i] = (int)nearbyint((double)(180 << 12) / (6.0 * i));
        quotients &= (int)nearbyintf(GF_SDIV_TOP / (float)i) == gf_sdiv[i] &&
                     (int)nearbyintf(GF_HDIV_TOP / (float)i) == gf_hdiv[i];
    }
    gf_quotients = quotients;
    __atomic_store_n(&gf_reciprocals_built, 1, __ATOMIC_RELEASE);
}

static void gf_hsv_scalar(const unsigned char *lut_h, const unsigned char *lut_s, const unsigned char *lut_v,
                          unsigned char *r, unsigned char *g, unsigned char *b, long start, long count) {
    const int *sdiv = gf_sdiv, *hdiv = gf_hdiv;
    for (long i = start; i < count; i++) {
        int red = r[i], green = g[i], blue = b[i];
        int v = red > green ? red : green;
        v = v > blue ? v : blue;
        int low = red < green ? red : green;
        low = low < blue ? low : blue;
        int diff = v - low;
        int s = (diff * sdiv[v] + 2048) >> 12;
        int raw = v == red ? green - blue : (v == green ? blue - red + 2 * diff : red - green + 4 * diff);
        int h = (raw * hdiv[diff] + 2048) >> 12;
        h += h < 0 ? 180 : 0;
        float hue = (float)(lut_h[h] * 2) * gf_sixtieth;
        int sector = (int)hue;
        float frac = hue - (float)sector;
        float sv = (float)lut_s[s] * gf_unit, vv = (float)lut_v[v] * gf_unit;
        float values[4] = {vv, vv * (1.0f - sv), vv * (1.0f - sv * frac), vv * (1.0f - sv * (1.0f - frac))};
        sector %= 6;
        r[i] = gf_clamp8((int)(values[gf_pick_r[sector]] * 255.0f + 1e-4f));
        g[i] = gf_clamp8((int)(values[gf_pick_g[sector]] * 255.0f + 1e-4f));
        b[i] = gf_clamp8((int)(values[gf_pick_b[sector]] * 255.0f + 1e-4f));
    }
}

#ifdef GF_HSV_X86
/* The tables as formulas: hue + shift mod 180, saturation and value as (int)min(x * gain, 255) in doubles, or as
 * min((x * fixed) >> 22, 255) in integers where that gives every entry the same (fixed != 0: most calls). */
struct gf_hsv_formulas {
    int shift, sat_fixed, val_fixed;
    double sat_gain, val_gain;
};

static int gf_hsv_fixed(const unsigned char *table, double gain) {
    for (int fixed = (int)(gain * (1 << 22)), tries = 0; tries < 2; fixed++, tries++) {
        int x = 0;
        while (x < 256 && table[x] == ((x * fixed) >> 22 < 255 ? (x * fixed) >> 22 : 255)) x++;
        if (x == 256) return fixed;
    }
    return 0;
}

static int gf_hsv_formulas(struct gf_hsv_formulas *f, const unsigned char *lut_h, const unsigned char *lut_s,
                           const unsigned char *lut_v, const double *gains) {
    if (gains == 0 || !(gains[0] >= 0.0 && gains[0] <= 8.0 && gains[1] >= 0.0 && gains[1] <= 8.0)) return 0;
    f->shift = lut_h[0];
    f->sat_gain = gains[0];
    f->val_gain = gains[1];
    for (int x = 0; x < 256; x++) {
        double sat = x * f->sat_gain, val = x * f->val_gain;
        if (x < 180 && lut_h[x] != (x + f->shift) % 180) return 0; /* OpenCV's hue is 0..179 */
        if (lut_s[x] != (sat < 255.0 ? (int)sat : 255) || lut_v[x] != (val < 255.0 ? (int)val : 255)) return 0;
    }
    f->sat_fixed = gf_hsv_fixed(lut_s, f->sat_gain);
    f->val_fixed = gf_hsv_fixed(lut_v, f->val_gain);
    return gf_quotients;
}

__attribute__((target("avx2"))) static inline __m256i gf_load8(const unsigned char *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

__attribute__((target("avx2"))) static inline void gf_store8(unsigned char *p, __m256 value) {
    __m256i x = _mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(value, _mm256_set1_ps(255.0f)), _mm256_set1_ps(1e-4f)));
    __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)); /* clamps at 0 */
    _mm_storel_epi64((__m128i *)p, _mm_packus_epi16(words, words));                               /* and at 255 */
}

/* A table's value as a unit float: min(x * gain, 255) truncated, times 1 / 255, the product in integers where
 * they give the table (`fixed`), else in doubles as the table's. */
__attribute__((target("avx2"))) static inline __m256 gf_gained_unit(__m256i x, int fixed, double gain) {
    if (fixed) {
        __m256i value = _mm256_min_epi32(_mm256_srli_epi32(_mm256_mullo_epi32(x, _mm256_set1_epi32(fixed)), 22),
                                         _mm256_set1_epi32(255));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(value), _mm256_set1_ps(gf_unit));
    }
    const __m256d top = _mm256_set1_pd(255.0), times = _mm256_set1_pd(gain);
    __m128i low = _mm256_cvttpd_epi32(_mm256_min_pd(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(x)), times), top));
    __m128i high =
        _mm256_cvttpd_epi32(_mm256_min_pd(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(x, 1)), times), top));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_set_m128i(high, low)), _mm256_set1_ps(gf_unit));
}

__attribute__((target("avx2"))) static inline __m256 gf_select(__m256 base, __m256 value, __m256 where) {
    return _mm256_blendv_ps(base, value, where);
}

__attribute__((target("avx2"))) static long gf_hsv_avx2(const struct gf_hsv_formulas *f, unsigned char *r,
                                                       unsigned char *g, unsigned char *b, long count) {
    const __m256i round = _mm256_set1_epi32(2048), zero = _mm256_setzero_si256(), wrap = _mm256_set1_epi32(180);
    const __m256i shift = _mm256_set1_epi32(f->shift), last = _mm256_set1_epi32(179);
    const __m256 one = _mm256_set1_ps(1.0f), sdiv_top = _mm256_set1_ps(GF_SDIV_TOP),
                 hdiv_top = _mm256_set1_ps(GF_HDIV_TOP), sixtieth = _mm256_set1_ps(gf_sixtieth);
    long i = 0;
    for (; i + 8 <= count; i += 8) {
        __m256i red = gf_load8(r + i), green = gf_load8(g + i), blue = gf_load8(b + i);
        __m256i v = _mm256_max_epi32(_mm256_max_epi32(red, green), blue);
        __m256i diff = _mm256_sub_epi32(v, _mm256_min_epi32(_mm256_min_epi32(red, green), blue));
        /* the reciprocals; at 0 the quotient is infinite, and what it multiplies is 0 (diff, raw) */
        __m256i sdiv = _mm256_cvtps_epi32(_mm256_div_ps(sdiv_top, _mm256_cvtepi32_ps(v)));
        __m256i hdiv = _mm256_cvtps_epi32(_mm256_div_ps(hdiv_top, _mm256_cvtepi32_ps(diff)));
        __m256i s = _mm256_srai_epi32(_mm256_add_epi32(_mm256_mullo_epi32(diff, sdiv), round), 12);
        __m256i from_red = _mm256_sub_epi32(green, blue);
        __m256i from_green = _mm256_add_epi32(_mm256_sub_epi32(blue, red), _mm256_slli_epi32(diff, 1));
        __m256i from_blue = _mm256_add_epi32(_mm256_sub_epi32(red, green), _mm256_slli_epi32(diff, 2));
        __m256i raw = _mm256_blendv_epi8(from_blue, from_green, _mm256_cmpeq_epi32(v, green));
        raw = _mm256_blendv_epi8(raw, from_red, _mm256_cmpeq_epi32(v, red)); /* red first, as the scalar test */
        __m256i h = _mm256_srai_epi32(_mm256_add_epi32(_mm256_mullo_epi32(raw, hdiv), round), 12);
        h = _mm256_add_epi32(h, _mm256_and_si256(_mm256_cmpgt_epi32(zero, h), wrap));
        h = _mm256_add_epi32(h, shift); /* lut_h[h]: (h + shift) mod 180 */
        h = _mm256_sub_epi32(h, _mm256_and_si256(_mm256_cmpgt_epi32(h, last), wrap));
        __m256 hue = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_slli_epi32(h, 1)), sixtieth);
        __m256i sector = _mm256_cvttps_epi32(hue); /* below 6 */
        __m256 frac = _mm256_sub_ps(hue, _mm256_cvtepi32_ps(sector));
        __m256 sv = gf_gained_unit(s, f->sat_fixed, f->sat_gain), vv = gf_gained_unit(v, f->val_fixed, f->val_gain);
        __m256 p = _mm256_mul_ps(vv, _mm256_sub_ps(one, sv));
        __m256 q = _mm256_mul_ps(vv, _mm256_sub_ps(one, _mm256_mul_ps(sv, frac)));
        __m256 tt = _mm256_mul_ps(vv, _mm256_sub_ps(one, _mm256_mul_ps(sv, _mm256_sub_ps(one, frac))));
        __m256 in[6];
        for (int k = 0; k < 6; k++) in[k] = _mm256_castsi256_ps(_mm256_cmpeq_epi32(sector, _mm256_set1_epi32(k)));
        /* sectors 0-5: red v q p p t v, green t v v q p p, blue p p t v v q */
        __m256 out_r = gf_select(gf_select(gf_select(vv, q, in[1]), p, _mm256_or_ps(in[2], in[3])), tt, in[4]);
        __m256 out_g = gf_select(gf_select(gf_select(p, tt, in[0]), vv, _mm256_or_ps(in[1], in[2])), q, in[3]);
        __m256 out_b = gf_select(gf_select(gf_select(vv, p, _mm256_or_ps(in[0], in[1])), tt, in[2]), q, in[5]);
        gf_store8(r + i, out_r);
        gf_store8(g + i, out_g);
        gf_store8(b + i, out_b);
    }
    return i;
}

/* The same loop sixteen pixels at once, where the CPU has AVX-512 (F and BW): the same steps, lane for lane. */
__attribute__((target("avx512f,avx512bw"))) static inline __m512i gf_load16(const unsigned char *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}

__attribute__((target("avx512f,avx512bw"))) static inline void gf_store16(unsigned char *p, __m512 value) {
    __m512i x = _mm512_cvttps_epi32(_mm512_add_ps(_mm512_mul_ps(value, _mm512_set1_ps(255.0f)), _mm512_set1_ps(1e-4f)));
    x = _mm512_max_epi32(x, _mm512_setzero_si512()); /* as packus: below 0 is 0, above 255 is 255 */
    _mm_storeu_si128((__m128i *)p, _mm512_cvtusepi32_epi8(x));
}

__attribute__((target("avx512f,avx512bw"))) static inline __m512 gf_gained_unit16(__m512i x, int fixed, double gain) {
    if (fixed) {
        __m512i value = _mm512_min_epi32(_mm512_srli_epi32(_mm512_mullo_epi32(x, _mm512_set1_epi32(fixed)), 22),
                                         _mm512_set1_epi32(255));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(value), _mm512_set1_ps(gf_unit));
    }
    const __m512d top = _mm512_set1_pd(255.0), times = _mm512_set1_pd(gain);
    __m256i low = _mm512_cvttpd_epi32(_mm512_min_pd(_mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(x)), times), top));
    __m256i high = _mm512_cvttpd_epi32(
        _mm512_min_pd(_mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(x, 1)), times), top));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1)),
                         _mm512_set1_ps(gf_unit));
}

__attribute__((target("avx512f,avx512bw"))) static long gf_hsv_avx512(const struct gf_hsv_formulas *f, unsigned char *r,
                                                                   unsigned char *g, unsigned char *b, long count) {
    const __m512i round = _mm512_set1_epi32(2048), wrap = _mm512_set1_epi32(180);
    const __m512i shift = _mm512_set1_epi32(f->shift), last = _mm512_set1_epi32(179);
    const __m512 one = _mm512_set1_ps(1.0f), sdiv_top = _mm512_set1_ps(GF_SDIV_TOP),
                 hdiv_top = _mm512_set1_ps(GF_HDIV_TOP), sixtieth = _mm512_set1_ps(gf_sixtieth);
    long i = 0;
    for (; i + 16 <= count; i += 16) {
        __m512i red = gf_load16(r + i), green = gf_load16(g + i), blue = gf_load16(b + i);
        __m512i v = _mm512_max_epi32(_mm512_max_epi32(red, green), blue);
        __m512i diff = _mm512_sub_epi32(v, _mm512_min_epi32(_mm512_min_epi32(red, green), blue));
        __m512i sdiv = _mm512_cvtps_epi32(_mm512_div_ps(sdiv_top, _mm512_cvtepi32_ps(v)));
        __m512i hdiv = _mm512_cvtps_epi32(_mm512_div_ps(hdiv_top, _mm512_cvtepi32_ps(diff)));
        __m512i s = _mm512_srai_epi32(_mm512_add_epi32(_mm512_mullo_epi32(diff, sdiv), round), 12);
        __m512i from_red = _mm512_sub_epi32(green, blue);
        __m512i from_green = _mm512_add_epi32(_mm512_sub_epi32(blue, red), _mm512_slli_epi32(diff, 1));
        __m512i from_blue = _mm512_add_epi32(_mm512_sub_epi32(red, green), _mm512_slli_epi32(diff, 2));
        __m512i raw = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(v, green), from_blue, from_green);
        raw = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(v, red), raw, from_red); /* red first */
        __m512i h = _mm512_srai_epi32(_mm512_add_epi32(_mm512_mullo_epi32(raw, hdiv), round), 12);
        h = _mm512_mask_add_epi32(h, _mm512_cmplt_epi32_mask(h, _mm512_setzero_si512()), h, wrap);
        h = _mm512_add_epi32(h, shift);
        h = _mm512_mask_sub_epi32(h, _mm512_cmpgt_epi32_mask(h, last), h, wrap);
        __m512 hue = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_slli_epi32(h, 1)), sixtieth);
        __m512i sector = _mm512_cvttps_epi32(hue);
        __m512 frac = _mm512_sub_ps(hue, _mm512_cvtepi32_ps(sector));
        __m512 sv = gf_gained_unit16(s, f->sat_fixed, f->sat_gain), vv = gf_gained_unit16(v, f->val_fixed, f->val_gain);
        __m512 p = _mm512_mul_ps(vv, _mm512_sub_ps(one, sv));
        __m512 q = _mm512_mul_ps(vv, _mm512_sub_ps(one, _mm512_mul_ps(sv, frac)));
        __m512 tt = _mm512_mul_ps(vv, _mm512_sub_ps(one, _mm512_mul_ps(sv, _mm512_sub_ps(one, frac))));
        __mmask16 in[6];
        for (int k = 0; k < 6; k++) in[k] = _mm512_cmpeq_epi32_mask(sector, _mm512_set1_epi32(k));
        __m512 out_r = _mm512_mask_blend_ps(in[4], _mm512_mask_blend_ps(in[2] | in[3], _mm512_mask_blend_ps(in[1], vv, q), p), tt);
        __m512 out_g = _mm512_mask_blend_ps(in[3], _mm512_mask_blend_ps(in[1] | in[2], _mm512_mask_blend_ps(in[0], p, tt), vv), q);
        __m512 out_b = _mm512_mask_blend_ps(in[5], _mm512_mask_blend_ps(in[2], _mm512_mask_blend_ps(in[0] | in[1], vv, p), tt), q);
        gf_store16(r + i, out_r);
        gf_store16(g + i, out_g);
        gf_store16(b + i, out_b);
    }
    return i;
}

static int gf_has_avx512(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? 1 : 0;
    }
    return known;
}
#endif

void gf_hsv(unsigned char *pixels, long plane, long count, const unsigned char *lut_h, const unsigned char *lut_s,
            const unsigned char *lut_v, const double *gains, int allow_simd) {
    unsigned char *r = pixels, *g = pixels + plane, *b = pixels + 2 * plane;
    long done = 0;
    gf_reciprocals();
#ifdef GF_HSV_X86
    struct gf_hsv_formulas formulas;
    if (allow_simd && gf_has_avx2() && gf_hsv_formulas(&formulas, lut_h, lut_s, lut_v, gains)) {
        if (allow_simd > 1 && gf_has_avx512()) done = gf_hsv_avx512(&formulas, r, g, b, count);
        done += gf_hsv_avx2(&formulas, r + done, g + done, b + done, count - done);
    }
#else
    (void)allow_simd;
    (void)gains;
#endif
    gf_hsv_scalar(lut_h, lut_s, lut_v, r, g, b, done, count);
}
