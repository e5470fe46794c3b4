/*
 * JPEG to smaller JPEG without leaving YCbCr: prepare's fast path.
 *
 * A 4:2:0 JPEG stores chroma at half the luma resolution, and the JPEG that
 * prepare writes stores it at half resolution again. The RGB path (decode to
 * RGB, resize, encode) makes libjpeg rebuild chroma at full resolution (at
 * M/8 scaling it runs a 2M-point IDCT per chroma block, in plain C), convert
 * to RGB, resize three channels at full resolution, then convert back and
 * average chroma down 2x2 in the encoder.
 *
 * gf_ycc_transcode keeps the image in its planes, in one call:
 *   decode   luma at M/8 of the stored size and chroma at M/8 of its own
 *            (M/16 of the stored size for 4:2:0, where each chroma block
 *            goes through an M-point IDCT of its lowest M x M coefficients,
 *            the same reduction libjpeg applies to luma), as raw planes
 *            without colour conversion; 4:2:2 and 4:4:4 sources too;
 *   resize   each plane on its own (resample.c): luma to the output size,
 *            chroma straight to the output's own chroma size;
 *   orient   each plane turned upright for the EXIF orientation;
 *   encode   the three planes as a baseline 4:2:0 JPEG with the settings
 *            Pillow uses (jpeg_set_quality, restart interval), again
 *            without colour conversion.
 *
 * The 4:2:0 chroma IDCT is installed over libjpeg's own after
 * jpeg_start_decompress through the public jpeg_inverse_dct layout (a
 * start_pass pointer followed by one method pointer per component), which
 * every libjpeg since 6b shares. It writes each chroma block's M x M samples
 * into the top-left quarter of the 2M x 2M cell libjpeg reserved for it, at
 * half the column: the caller hands libjpeg chroma row pointers laid out so
 * that those quarters form a contiguous plane. Where libjpeg scaled the
 * components otherwise than this assumes, the image takes the RGB path.
 *
 * Plain C with no Python API, in one library with jpegregion.c and
 * resample.c, called through ctypes.
 */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

#include "gpufeed.h"
#include "jpegcommon.h"

typedef void (*gf_idct_method)(j_decompress_ptr, jpeg_component_info *, JCOEFPTR, JSAMPARRAY, JDIMENSION);

/* jpegint.h's struct jpeg_inverse_dct, which jpeglib.h leaves opaque. */
struct gf_inverse_dct {
    void (*start_pass)(j_decompress_ptr);
    gf_idct_method inverse_DCT[MAX_COMPONENTS];
};

struct gf_ycc_state {
    int m;                    /* output points per block side: the M of M/8 */
    int32_t basis[8][8];      /* basis[x][u]: C(u)/2 cos((2x+1)u pi / 2M), scaled by 2^13 */
};

#define GF_CONST_BITS 13
#define GF_PASS1_BITS 2

static void gf_ycc_basis(struct gf_ycc_state *state, int m) {
    const double pi = 3.14159265358979323846;
    state->m = m;
    memset(state->basis, 0, sizeof(state->basis));
    for (int x = 0; x < m; x++) {
        for (int u = 0; u < m; u++) {
            double c = (u == 0 ? 0.70710678118654752440 : 1.0) / 2.0;
            double v = c * __builtin_cos((2.0 * x + 1.0) * u * pi / (2.0 * m));
            state->basis[x][u] = (int32_t)__builtin_lround(v * (double)(1 << GF_CONST_BITS));
        }
    }
}

/*
 * The M-point IDCT of a block's lowest M x M coefficients, in fixed point
 * (64-bit products: corrupt data can hold any 16-bit coefficient). Output
 * goes to rows 0..M-1 of the 2M-row cell, at column output_col / 2. Inlined
 * for the common M so that the loops unroll; a block with only a DC term
 * (most chroma blocks) takes the same arithmetic without the zero terms.
 */
static inline __attribute__((always_inline)) void gf_idct_m(const int32_t (*basis)[8], const UINT16 *quant,
                                                            JCOEFPTR coef, JSAMPARRAY output_buf, JDIMENSION col,
                                                            const int m) {
    int64_t workspace[8][8]; /* [v][x] */
    const int64_t round1 = 1 << (GF_CONST_BITS - GF_PASS1_BITS - 1);
    const int64_t round2 = (int64_t)1 << (GF_CONST_BITS + GF_PASS1_BITS - 1);
    int ac = 0;
    for (int v = 0; v < m; v++) {
        for (int u = 0; u < m; u++) {
            ac |= (u | v) != 0 && coef[v * DCTSIZE + u] != 0;
        }
    }
    if (!ac) {
        int64_t dc = (int64_t)coef[0] * quant[0];
        int64_t first = (dc * basis[0][0] + round1) >> (GF_CONST_BITS - GF_PASS1_BITS);
        int64_t value = ((first * basis[0][0] + round2) >> (GF_CONST_BITS + GF_PASS1_BITS)) + CENTERJSAMPLE;
        JSAMPLE sample = (JSAMPLE)(value < 0 ? 0 : value > MAXJSAMPLE ? MAXJSAMPLE : value);
        for (int y = 0; y < m; y++) {
            for (int x = 0; x < m; x++) {
                output_buf[y][col + x] = sample;
            }
        }
        return;
    }
    for (int v = 0; v < m; v++) {
        int64_t row[8];
        for (int u = 0; u < m; u++) {
            row[u] = (int64_t)coef[v * DCTSIZE + u] * quant[v * DCTSIZE + u];
        }
        for (int x = 0; x < m; x++) {
            int64_t sum = 0;
            for (int u = 0; u < m; u++) {
                sum += row[u] * basis[x][u];
            }
            workspace[v][x] = (sum + round1) >> (GF_CONST_BITS - GF_PASS1_BITS);
        }
    }
    for (int y = 0; y < m; y++) {
        JSAMPROW out = output_buf[y] + col;
        for (int x = 0; x < m; x++) {
            int64_t sum = 0;
            for (int v = 0; v < m; v++) {
                sum += workspace[v][x] * basis[y][v];
            }
            int64_t value = ((sum + round2) >> (GF_CONST_BITS + GF_PASS1_BITS)) + CENTERJSAMPLE;
            out[x] = (JSAMPLE)(value < 0 ? 0 : value > MAXJSAMPLE ? MAXJSAMPLE : value);
        }
    }
}

/* gf_ycc_basis's values for the two common scales (shorter side 256 from
 * 0.7-1.6 MP photos) as constants, so that the compiler drops the zero terms
 * and folds the rest: the same sums, fewer multiplications. */
static const int32_t gf_basis2[8][8] = {{2896, 2896}, {2896, -2896}};
static const int32_t gf_basis3[8][8] = {{2896, 3547, 2048}, {2896, 0, -4096}, {2896, -3547, 2048}};

/* The constant tables above must be what gf_ycc_basis computes; a test checks it. */
int gf_ycc_basis_check(void) {
    struct gf_ycc_state state;
    gf_ycc_basis(&state, 2);
    int same = memcmp(state.basis, gf_basis2, sizeof(state.basis)) == 0;
    gf_ycc_basis(&state, 3);
    return same && memcmp(state.basis, gf_basis3, sizeof(state.basis)) == 0;
}

/* Any other scale: the loops keep m as a variable. */
static void gf_idct_any(const int32_t (*basis)[8], const UINT16 *quant, JCOEFPTR coef, JSAMPARRAY output_buf,
                        JDIMENSION col, int m) {
    gf_idct_m(basis, quant, coef, output_buf, col, m);
}

static void gf_idct_compact(j_decompress_ptr cinfo, jpeg_component_info *compptr, JCOEFPTR coef,
                            JSAMPARRAY output_buf, JDIMENSION output_col) {
    static const UINT16 no_table[DCTSIZE2]; /* all zero */
    const struct gf_ycc_state *state = (const struct gf_ycc_state *)cinfo->client_data;
    /* A damaged progressive file may leave a component without a scan, so without a quantisation table:
     * libjpeg's own IDCT then multiplies by zeros (its dct_table stays zeroed), and so does this one. */
    const UINT16 *quant = compptr->quant_table != NULL ? compptr->quant_table->quantval : no_table;
    JDIMENSION col = output_col / 2;
    if (state->m == 3) {
        gf_idct_m(gf_basis3, quant, coef, output_buf, col, 3);
    } else if (state->m == 2) {
        gf_idct_m(gf_basis2, quant, coef, output_buf, col, 2);
    } else {
        gf_idct_any(state->basis, quant, coef, output_buf, col, state->m);
    }
}

/* Output samples per block side of a component (libjpeg 7+ has one per axis). */
static int gf_scaled_size(const jpeg_component_info *component) {
#if JPEG_LIB_VERSION >= 70
    return component->DCT_h_scaled_size == component->DCT_v_scaled_size ? component->DCT_h_scaled_size : -1;
#else
    return component->DCT_scaled_size;
#endif
}

static int gf_div_up(long a, long b) { return (int)((a + b - 1) / b); }

/*
 * The plane geometry for a width x height image decoded at scale m/8 with
 * luma sampling hy x vy (chroma 1 x 1): luma w, h, stride, rows; chroma w,
 * h, stride, rows (each of Cb and Cr), chroma at m/8 of its own resolution.
 * Strides and rows cover every block libjpeg writes, whole iMCU rows.
 */
static void gf_ycc_geometry(int width, int height, int m, int hy, int vy, int *g) {
    int imcu_rows = gf_div_up(height, 8 * vy);
    g[0] = gf_div_up((long)width * m, 8);
    g[1] = gf_div_up((long)height * m, 8);
    g[2] = gf_div_up(width, 8) * m;
    g[3] = imcu_rows * vy * m;
    g[4] = gf_div_up((long)width * m, 8 * hy);
    g[5] = gf_div_up((long)height * m, 8 * vy);
    g[6] = gf_div_up(gf_div_up(width, hy), 8) * m;
    g[7] = imcu_rows * m;
}

/* Decoded planes: luma, then Cb and Cr, with gf_ycc_geometry's layout. */
struct gf_planes {
    int g[8];
    int hy, vy; /* the luma's sampling factors: chroma is 1/hy x 1/vy of it */
    unsigned char *luma, *cb, *cr;
};

/*
 * Decode at scale m/8 into planes (allocated here: free planes->luma).
 * Returns 0, GF_YCC_OTHER (nothing decoded), GF_YCC_NO_MEMORY, or -1 with
 * libjpeg's message for corrupt data (warnings count: libjpeg would fill
 * the rest with grey).
 */
static int gf_ycc_decode(const unsigned char *data, unsigned long size, int m, struct gf_planes *planes, char *message,
                         int message_size) {
    struct jpeg_decompress_struct cinfo;
    struct gf_error error;
    struct gf_ycc_state state;
    JSAMPROW rows[2 * 8 + 2 * 2 * 8];
    unsigned char *volatile buffer = NULL;
    unsigned char *volatile scratch = NULL;
    int status = 0;

    cinfo.err = gf_error_init(&error, message, message_size);
    if (setjmp(error.jump)) {
        jpeg_destroy_decompress(&cinfo);
        free(buffer);
        free(scratch);
        return -1;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, size);
    jpeg_read_header(&cinfo, TRUE);
    /* 4:2:0 (2x2), 4:2:2 (2x1) or 4:4:4 (1x1) luma, 1x1 chroma. */
    const int hy = cinfo.num_components == 3 ? cinfo.comp_info[0].h_samp_factor : 0;
    const int vy = cinfo.num_components == 3 ? cinfo.comp_info[0].v_samp_factor : 0;
    if (cinfo.num_components != 3 || cinfo.jpeg_color_space != JCS_YCbCr || !(hy == 2 || (hy == 1 && vy == 1)) ||
        vy < 1 || vy > 2 || cinfo.comp_info[1].h_samp_factor != 1 || cinfo.comp_info[1].v_samp_factor != 1 ||
        cinfo.comp_info[2].h_samp_factor != 1 || cinfo.comp_info[2].v_samp_factor != 1 ||
        cinfo.data_precision != 8) {
        jpeg_destroy_decompress(&cinfo);
        return GF_YCC_OTHER;
    }
    int *g = planes->g;
    planes->hy = hy;
    planes->vy = vy;
    gf_ycc_geometry((int)cinfo.image_width, (int)cinfo.image_height, m, hy, vy, g);
    size_t luma_bytes = (size_t)g[2] * (size_t)g[3], chroma_bytes = (size_t)g[6] * (size_t)g[7];
    buffer = malloc(luma_bytes + 2 * chroma_bytes);
    scratch = malloc((size_t)g[6] * 2 + 64);
    if (buffer == NULL || scratch == NULL) {
        jpeg_destroy_decompress(&cinfo);
        free(buffer);
        free(scratch);
        return GF_YCC_NO_MEMORY;
    }

    cinfo.raw_data_out = TRUE;
    cinfo.dct_method = JDCT_ISLOW;
    cinfo.scale_num = (unsigned int)m;
    cinfo.scale_denom = 8;
    jpeg_start_decompress(&cinfo);
    /* libjpeg-turbo gives 4:2:0 chroma a 2M-point IDCT (M < 8), so that it
     * comes out at the luma's size; 4:2:2 and 4:4:4 chroma an M-point one. */
    const int cell = gf_scaled_size(&cinfo.comp_info[1]), compact = hy == 2 && vy == 2 && m < 8 && cell == 2 * m;
    if ((int)cinfo.output_width != g[0] || (int)cinfo.output_height != g[1] ||
        gf_scaled_size(&cinfo.comp_info[0]) != m || gf_scaled_size(&cinfo.comp_info[2]) != cell ||
        (cell != m && !compact)) {
        status = GF_YCC_OTHER; /* a libjpeg that scales differently than the layout here assumes */
    } else {
        if (compact) {
            gf_ycc_basis(&state, m);
            cinfo.client_data = &state;
            struct gf_inverse_dct *idct = (struct gf_inverse_dct *)cinfo.idct;
            idct->inverse_DCT[1] = gf_idct_compact;
            idct->inverse_DCT[2] = gf_idct_compact;
        }
        /* Per call libjpeg fills one iMCU row: vy * M luma rows and, per
         * chroma component, M rows, or 2M of which the first M are ours. */
        int luma_rows = vy * m, chroma_rows = compact ? 2 * m : m;
        JSAMPARRAY out[3] = {rows, rows + luma_rows, rows + luma_rows + chroma_rows};
        unsigned char *luma = buffer, *cb = buffer + luma_bytes, *cr = cb + chroma_bytes;
        for (int imcu = 0; cinfo.output_scanline < cinfo.output_height; imcu++) {
            for (int r = 0; r < luma_rows; r++) {
                rows[r] = luma + ((size_t)imcu * luma_rows + r) * g[2];
            }
            for (int r = 0; r < chroma_rows; r++) {
                out[1][r] = r < m ? cb + ((size_t)imcu * m + r) * g[6] : scratch;
                out[2][r] = r < m ? cr + ((size_t)imcu * m + r) * g[6] : scratch;
            }
            if (jpeg_read_raw_data(&cinfo, out, (JDIMENSION)luma_rows) == 0 || error.warned) {
                break;
            }
        }
        if (error.warned) {
            status = -1;
        } else {
            jpeg_finish_decompress(&cinfo);
            status = error.warned ? -1 : 0;
        }
    }
    jpeg_destroy_decompress(&cinfo);
    free(scratch);
    if (status != 0) {
        free(buffer);
        return status;
    }
    planes->luma = buffer;
    planes->cb = buffer + luma_bytes;
    planes->cr = buffer + luma_bytes + chroma_bytes;
    return 0;
}

/* Destination: the caller's buffer; running past its end is an error. */
struct gf_buffer_dest {
    struct jpeg_destination_mgr pub;
    int overflow;
};

static void gf_dest_init(j_compress_ptr cinfo) { (void)cinfo; }

static boolean gf_dest_full(j_compress_ptr cinfo) {
    ((struct gf_buffer_dest *)cinfo->dest)->overflow = 1;
    ERREXIT(cinfo, JERR_BUFFER_SIZE);
    return FALSE;
}

static void gf_dest_term(j_compress_ptr cinfo) { (void)cinfo; }

/*
 * Encode width x height luma and ceil(width/2) x ceil(height/2) chroma
 * planes (each with its own stride) as a baseline 4:2:0 JPEG at quality,
 * with a restart marker every `restart` MCUs (0: none). Edges are padded by
 * repeating the last column and row, as libjpeg does for RGB input. Returns
 * the JPEG's length, 0 when capacity was too small, -1 on error (or
 * GF_YCC_NO_MEMORY).
 */
static long gf_ycc_encode(const unsigned char *luma, int luma_stride, const unsigned char *cb, const unsigned char *cr,
                   int chroma_stride, int width, int height, int quality, int restart, unsigned char *out,
                   unsigned long capacity, char *message, int message_size) {
    struct jpeg_compress_struct cinfo;
    struct gf_error error;
    struct gf_buffer_dest dest;
    long result;

    if (width < 1 || height < 1 || quality < 1 || quality > 100 || restart < 0 || restart > 65535) {
        return -1;
    }
    int cw = (width + 1) / 2, ch = (height + 1) / 2;
    int luma_width = gf_div_up(width, 8) * 8, chroma_width = gf_div_up(cw, 8) * 8;
    /* 16 luma and 8 + 8 chroma rows per call, each padded to whole blocks. */
    size_t luma_block = (size_t)luma_width * 16, chroma_block = (size_t)chroma_width * 8;
    unsigned char *work = malloc(luma_block + 2 * chroma_block);
    if (work == NULL) {
        return GF_YCC_NO_MEMORY;
    }
    memset(&dest, 0, sizeof(dest));
    cinfo.err = gf_error_init(&error, message, message_size);
    if (setjmp(error.jump)) {
        result = dest.overflow ? 0 : -1;
        jpeg_destroy_compress(&cinfo);
        free(work);
        return result;
    }
    jpeg_create_compress(&cinfo);
    dest.pub.next_output_byte = out;
    dest.pub.free_in_buffer = capacity;
    dest.pub.init_destination = gf_dest_init;
    dest.pub.empty_output_buffer = gf_dest_full;
    dest.pub.term_destination = gf_dest_term;
    cinfo.dest = &dest.pub;
    cinfo.image_width = (JDIMENSION)width;
    cinfo.image_height = (JDIMENSION)height;
    cinfo.input_components = 3;
    cinfo.in_color_space = JCS_YCbCr;
    jpeg_set_defaults(&cinfo);
    jpeg_set_quality(&cinfo, quality, TRUE);
    cinfo.restart_interval = (unsigned int)restart;
    cinfo.raw_data_in = TRUE;

    JSAMPROW luma_rows[16], cb_rows[8], cr_rows[8];
    JSAMPARRAY planes[3] = {luma_rows, cb_rows, cr_rows};
    jpeg_start_compress(&cinfo, TRUE);
    for (int top = 0; top < height; top += 16) {
        for (int r = 0; r < 16; r++) {
            int source = top + r < height ? top + r : height - 1;
            unsigned char *row = work + (size_t)r * luma_width;
            memcpy(row, luma + (size_t)source * luma_stride, (size_t)width);
            memset(row + width, row[width - 1], (size_t)(luma_width - width));
            luma_rows[r] = row;
        }
        for (int r = 0; r < 8; r++) {
            int source = top / 2 + r < ch ? top / 2 + r : ch - 1;
            unsigned char *row_cb = work + luma_block + (size_t)r * chroma_width;
            unsigned char *row_cr = row_cb + chroma_block;
            memcpy(row_cb, cb + (size_t)source * chroma_stride, (size_t)cw);
            memset(row_cb + cw, row_cb[cw - 1], (size_t)(chroma_width - cw));
            memcpy(row_cr, cr + (size_t)source * chroma_stride, (size_t)cw);
            memset(row_cr + cw, row_cr[cw - 1], (size_t)(chroma_width - cw));
            cb_rows[r] = row_cb;
            cr_rows[r] = row_cr;
        }
        jpeg_write_raw_data(&cinfo, planes, 16);
    }
    jpeg_finish_compress(&cinfo);
    result = (long)(capacity - dest.pub.free_in_buffer);
    jpeg_destroy_compress(&cinfo);
    free(work);
    return result;
}

/*
 * The whole job for one image. box: the region of the stored image (its
 * pixel coordinates, x0 y0 x1 y1) that becomes out_w x out_h, both before
 * orientation. The chroma region is given too (chroma_box, also in stored
 * pixels), because the output's chroma covers 2 * ceil(out / 2) luma pixels:
 * for an odd size it reaches half a chroma pixel past the edge that ends up
 * right or bottom once upright. `filter`: resample.c's GF_BILINEAR,
 * GF_BICUBIC or GF_LANCZOS. Returns the JPEG's length in out, 0 when
 * capacity was too small, -1 for corrupt data (libjpeg's text in message,
 * unless that is NULL), GF_YCC_OTHER or GF_YCC_NO_MEMORY.
 */
long gf_ycc_transcode(const unsigned char *data, unsigned long size, int m, const double *box,
                      const double *chroma_box, int out_w, int out_h, int filter, int orientation, int quality,
                      int restart, unsigned char *out, unsigned long capacity, char *message, int message_size) {
    struct gf_planes planes;
    long result = GF_YCC_NO_MEMORY;

    if (m < 1 || m > 8 || out_w < 1 || out_h < 1 || orientation < 1 || orientation > 8) {
        snprintf(message, (size_t)message_size, "bad arguments");
        return -1;
    }
    int status = gf_ycc_decode(data, size, m, &planes, message, message_size);
    if (status != 0) {
        return status;
    }
    const int *g = planes.g;
    int cw = (out_w + 1) / 2, ch = (out_h + 1) / 2;
    size_t luma_bytes = (size_t)out_w * out_h, chroma_bytes = (size_t)cw * ch;
    unsigned char *resized = malloc(2 * (luma_bytes + 2 * chroma_bytes));
    if (resized != NULL) {
        unsigned char *luma = resized, *cb = luma + luma_bytes, *cr = cb + chroma_bytes;
        double luma_box[4], scaled_chroma[4];
        for (int i = 0; i < 4; i++) {
            luma_box[i] = box[i] * m / 8.0;
            scaled_chroma[i] = chroma_box[i] * m / (8.0 * (i % 2 == 0 ? planes.hy : planes.vy));
        }
        if (gf_plane_resize(planes.luma, g[2], g[0], g[1], luma_box, luma, out_w, out_w, out_h, filter, 1) == 0 &&
            gf_plane_resize(planes.cb, g[6], g[4], g[5], scaled_chroma, cb, cw, cw, ch, filter, 1) == 0 &&
            gf_plane_resize(planes.cr, g[6], g[4], g[5], scaled_chroma, cr, cw, cw, ch, filter, 1) == 0) {
            int width = out_w, height = out_h, chroma_width = cw;
            if (orientation != 1) {
                int turned = orientation >= 5;
                unsigned char *upright = resized + luma_bytes + 2 * chroma_bytes;
                unsigned char *upright_cb = upright + luma_bytes, *upright_cr = upright_cb + chroma_bytes;
                width = turned ? out_h : out_w;
                height = turned ? out_w : out_h;
                chroma_width = turned ? ch : cw;
                if (gf_plane_orient(luma, out_w, out_w, out_h, orientation, upright, width) != 0 ||
                    gf_plane_orient(cb, cw, cw, ch, orientation, upright_cb, chroma_width) != 0 ||
                    gf_plane_orient(cr, cw, cw, ch, orientation, upright_cr, chroma_width) != 0) {
                    goto done;
                }
                luma = upright;
                cb = upright_cb;
                cr = upright_cr;
            }
            result = gf_ycc_encode(luma, width, cb, cr, chroma_width, width, height, quality, restart, out, capacity,
                                   message, message_size);
        }
    }
done:
    free(resized);
    free(planes.luma);
    return result;
}
