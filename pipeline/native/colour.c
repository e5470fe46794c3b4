/*
 * Photometric augmentation on uint8 planar RGB (a loader's CHW slot): ultralytics' HSV gains.
 *
 * gf_hsv converts each pixel to OpenCV's 8-bit HSV in its fixed point (hue in degrees / 2,
 * 12-bit reciprocal tables rounded half to even), sends H, S and V through the three lookup
 * tables the caller built (ultralytics' gains, truncated to 8 bits), and converts back as
 * OpenCV's vector path does (floats, truncated). pipeline/augment/hsv.py holds the same
 * arithmetic in torch for batches on a GPU; tests/augment compare both with ultralytics.
 */

#include <math.h>

#include "gpufeed.h"

void gf_hsv(unsigned char *pixels, long plane, long count, const unsigned char *lut_h, const unsigned char *lut_s,
            const unsigned char *lut_v) {
    int sdiv[256], hdiv[256];
    sdiv[0] = hdiv[0] = 0;
    for (int i = 1; i < 256; i++) {
        sdiv[i] = (int)nearbyint((double)(255 << 12) / i);
        hdiv[i] = (int)nearbyint((double)(180 << 12) / (6.0 * i));
    }
    unsigned char *r = pixels, *g = pixels + plane, *b = pixels + 2 * plane;
    for (long i = 0; i < count; i++) {
        int red = r[i], green = g[i], blue = b[i];
        int v = red > green ? red : green;
        v = v > blue ? v : blue;
        int low = red < green ? red : green;
        low = low < blue ? low : blue;
        int diff = v - low;
        int s = (diff * sdiv[v] + 2048) >> 12;
        int raw = v == red ? green - blue : (v == green ? blue - red + 2 * diff : red - green + 4 * diff);
        int h = (raw * hdiv[diff] + 2048) >> 12;
        if (h < 0) h += 180;
        h = lut_h[h];
        s = lut_s[s];
        v = lut_v[v];
        float hue = (float)(h * 2) / 60.0f;
        int sector = (int)hue; /* truncation is the floor here: everything is >= 0 (and no libm call) */
        float frac = hue - (float)sector;
        sector %= 6;
        float sv = (float)s / 255.0f, vv = (float)v / 255.0f;
        float p = vv * (1.0f - sv), q = vv * (1.0f - sv * frac), t = vv * (1.0f - sv * (1.0f - frac));
        float out_r, out_g, out_b;
        switch (sector) {
            case 0: out_r = vv; out_g = t; out_b = p; break;
            case 1: out_r = q; out_g = vv; out_b = p; break;
            case 2: out_r = p; out_g = vv; out_b = t; break;
            case 3: out_r = p; out_g = q; out_b = vv; break;
            case 4: out_r = t; out_g = p; out_b = vv; break;
            default: out_r = vv; out_g = p; out_b = q; break;
        }
        int x = (int)(out_r * 255.0f + 1e-4f), y = (int)(out_g * 255.0f + 1e-4f), z = (int)(out_b * 255.0f + 1e-4f);
        r[i] = (unsigned char)(x < 0 ? 0 : (x > 255 ? 255 : x));
        g[i] = (unsigned char)(y < 0 ? 0 : (y > 255 ? 255 : y));
        b[i] = (unsigned char)(z < 0 ? 0 : (z > 255 ? 255 : z));
    }
}
