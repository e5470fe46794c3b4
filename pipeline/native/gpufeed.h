/*
 * What gpufeed's Python code calls through ctypes (pipeline/native/bindings.py
 * declares the same signatures), and the codes those calls return. Every C
 * file includes it, so a definition that drifts from its prototype does not
 * compile. Plain C with no Python API; each function is documented where it
 * is defined.
 */

#ifndef GPUFEED_H
#define GPUFEED_H

#include <stdint.h>

/* Resample arithmetic (`mode`): bindings.PILLOW, bindings.PILLOW_SIMD. */
#define GF_PILLOW 0      /* Pillow: 22-bit int32 coefficients */
#define GF_PILLOW_SIMD 1 /* Pillow-SIMD: int16 coefficients at the largest precision that fits */

/* Resize filters (`filter`), as prepare's transcode names them. */
#define GF_BILINEAR 0
#define GF_BICUBIC 1
#define GF_LANCZOS 2

/* Status codes: 0 is success and -1 an error with libjpeg's message everywhere. */
#define GF_UNSUPPORTED -2   /* a CMYK/YCCK JPEG, which libjpeg-turbo cannot convert to RGB */
#define GF_OUT_OF_MEMORY -3 /* gf_crop_many, gf_jpeg_warnings: the decode or resize buffers */
#define GF_OVER_LIMITS 2    /* gf_crop_many: the image is empty or over max_pixels */
#define GF_YCC_OTHER -2     /* gf_ycc_transcode: not an 8-bit YCbCr 4:2:0, 4:2:2 or 4:4:4 JPEG */
#define GF_YCC_NO_MEMORY -3 /* gf_ycc_transcode: out of memory */

/* jpegregion.c: headers and region decodes of JPEGs. */
int gf_header(const unsigned char *data, unsigned long size, int *info, char *message, int message_size);
int gf_jpeg_warnings(const unsigned char *data, unsigned long size, char *message, int message_size);
int gf_decode_region(const unsigned char *data, unsigned long size, int scale_num, int x, int y, int w, int h,
                     unsigned char *out, unsigned long out_size, int *out_info, char *message, int message_size);
long gf_region_jpeg(const unsigned char *data, unsigned long size, int scale_num, int x, int y, int w, int h,
                    unsigned char *out, unsigned long out_size, int *origin);
void gf_header_many(int n, const unsigned char *const *data, const unsigned long *sizes, int *info, int *status);
void gf_decode_region_many(int n, const unsigned char *const *data, const unsigned long *sizes, const int *params,
                           unsigned char *const *outs, const unsigned long *out_sizes, int *info, int *status,
                           char *messages, int message_size);

/* resample.c: storing, resizing and the loader's whole crop in one call. */
void gf_store_rgbx(const unsigned char *src, int w, int h, int flip, unsigned char *out, long stride_c, long stride_y,
                   long stride_x);
void gf_store_rgbx_f32(const unsigned char *src, int w, int h, int flip, float *out, long stride_c, long stride_y,
                       long stride_x, const float *scale, const float *shift);
int gf_resize_store(const unsigned char *src, int w, int h, const double *box, int out_w, int out_h, int mode,
                    int filter, int flip, void *out, long stride_c, long stride_y, long stride_x, const float *scale,
                    const float *shift, int allow_simd);
int gf_plane_resize(const unsigned char *src, long src_stride, int w, int h, const double *box, unsigned char *out,
                    long out_stride, int out_w, int out_h, int filter, int allow_simd);
int gf_plane_orient(const unsigned char *src, long src_stride, int w, int h, int orientation, unsigned char *out,
                    long out_stride);
void gf_plan_many(int n, const int *info, const int *status, const uint64_t *seeds, const int *shape,
                  const double *spec, int *params, double *boxes, unsigned long *sizes);
void gf_crop_many(int n, const unsigned char *const *data, const unsigned long *sizes, const uint64_t *seeds,
                  const int *shape, const double *spec, double max_pixels, void *const *targets,
                  const unsigned char *flips, int mode, long stride_c, long stride_y, long stride_x, const float *scale,
                  const float *shift, int *status, char *messages, int message_size);

/* ycc.c: prepare's JPEG-to-JPEG path without leaving YCbCr. */
long gf_ycc_transcode(const unsigned char *data, unsigned long size, int m, const double *box,
                      const double *chroma_box, int out_w, int out_h, int filter, int orientation, int quality,
                      int restart, unsigned char *out, unsigned long capacity, char *message, int message_size);
int gf_ycc_basis_check(void);

/* _libgpufeed.c, only in the library that `pip install` builds: the digest of the sources it was built from. */
const char *gf_source_digest(void);

/* resample.c: whether this CPU runs the AVX2 kernels (checked once; 0 in the portable build, -DGF_NO_SIMD). */
int gf_has_avx2(void);

/* colour.c: photometric augmentation. gains: the multipliers the saturation and value tables were built with
 * (1 + gain, doubles), or NULL (the scalar loop then); allow_simd 0 the scalar loop, 1 AVX2, 2 AVX-512 where
 * the CPU has it. */
void gf_hsv(unsigned char *pixels, long plane, long count, const unsigned char *lut_h, const unsigned char *lut_s,
            const unsigned char *lut_v, const double *gains, int allow_simd);

#endif
