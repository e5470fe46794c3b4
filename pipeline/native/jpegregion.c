/*
 * Decode only a region of a JPEG, scaled in the DCT domain, with libjpeg-turbo.
 *
 * A random-resized crop keeps on average about half of a training image, so
 * decoding the whole image wastes half the IDCT, upsampling and colour
 * conversion work. libjpeg-turbo can skip whole rows above the region
 * (jpeg_skip_scanlines), stop below it, and restrict each row to the iMCU
 * columns the region needs (jpeg_crop_scanline); M/8 scaling (scale_num)
 * shrinks large crops during the IDCT. Pixels come out as RGBX, Pillow's own
 * layout, so Python wraps the buffer as an image without a copy.
 *
 * resample.c then resizes the crop and writes it into the batch buffer's
 * layout, flipped when asked, in one pass.
 *
 * Plain C with no Python API, part of the library that `pip install` builds
 * (pipeline/native/build.py); Python calls it through ctypes, which releases
 * the GIL for the whole call.
 */

#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

#include "gpufeed.h"
#include "jpegcommon.h"

#define GF_ROWS 16

static void gf_setup(struct jpeg_decompress_struct *cinfo, struct gf_error *error, char *message, int size) {
    cinfo->err = gf_error_init(error, message, size);
}

/* info: width, height, components, colour space (J_COLOR_SPACE). 0 or -1. */
int gf_header(const unsigned char *data, unsigned long size, int *info, char *message, int message_size) {
    struct jpeg_decompress_struct cinfo;
    struct gf_error error;

    gf_setup(&cinfo, &error, message, message_size);
    if (setjmp(error.jump)) {
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, size);
    jpeg_read_header(&cinfo, TRUE);
    info[0] = (int)cinfo.image_width;
    info[1] = (int)cinfo.image_height;
    info[2] = cinfo.num_components;
    info[3] = (int)cinfo.jpeg_color_space;
    jpeg_destroy_decompress(&cinfo);
    return 0;
}

/*
 * Every distinct warning libjpeg gives while decoding the whole JPEG, one a
 * line in `message` (those that fit), for a file that a fast path refused
 * on a warning and Pillow then read. Decoded at 1/8 scale: the marker reader
 * and the entropy decoder, which meet the corrupt data, still read every
 * byte. Returns the number of warnings (0: none; repeats count), -1 with
 * libjpeg's error in `message` instead, or GF_OUT_OF_MEMORY.
 */
int gf_jpeg_warnings(const unsigned char *data, unsigned long size, char *message, int message_size) {
    struct jpeg_decompress_struct cinfo;
    struct gf_error error;
    JSAMPROW row[1];
    JSAMPLE *volatile buffer = NULL;
    int warnings;

    gf_setup(&cinfo, &error, message, message_size);
    error.collect = 1;
    if (setjmp(error.jump)) {
        jpeg_destroy_decompress(&cinfo);
        free(buffer);
        return -1;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, size);
    jpeg_read_header(&cinfo, TRUE);
    cinfo.scale_num = 1;
    cinfo.scale_denom = 8;
    cinfo.do_fancy_upsampling = FALSE;
    jpeg_start_decompress(&cinfo);
    buffer = malloc((size_t)cinfo.output_width * (size_t)cinfo.output_components);
    if (buffer == NULL) {
        jpeg_destroy_decompress(&cinfo);
        return GF_OUT_OF_MEMORY;
    }
    row[0] = buffer;
    while (cinfo.output_scanline < cinfo.output_height && jpeg_read_scanlines(&cinfo, row, 1) == 1) {
    }
    jpeg_finish_decompress(&cinfo); /* reads on to the end: warnings after the last scan count too */
    warnings = error.warned;
    jpeg_destroy_decompress(&cinfo);
    free(buffer);
    return warnings;
}

/*
 * Restart markers make a crop's blocks reachable without entropy-decoding
 * the rest of the image: with a restart every R MCUs (R dividing the MCUs in
 * a row), each run of R MCUs is coded independently (DC prediction restarts
 * at each marker). The runs covering the crop's MCU rectangle are copied,
 * behind the original headers with the frame size patched, into a small
 * JPEG of just that rectangle, with its restart markers renumbered; libjpeg
 * then decodes only those blocks. gpufeed prepare writes JPEGs with a
 * restart every MCU for this.
 */
struct gf_layout {
    unsigned long sof;  /* offset of the frame header's height field */
    unsigned long scan; /* first entropy-coded byte */
    int width, height;
    int mcu_width, mcu_height; /* in pixels */
    int columns, rows;         /* MCUs */
    int restart;               /* MCUs per restart interval; 0: none */
};

static unsigned gf_be16(const unsigned char *p) { return ((unsigned)p[0] << 8) | p[1]; }

/* The layout of a baseline, single-scan JPEG with restart intervals that
 * divide its MCU rows; 0 when it is anything else (the caller decodes it the
 * ordinary way, which also reports any corruption). */
static int gf_parse_layout(const unsigned char *data, unsigned long size, struct gf_layout *layout) {
    unsigned long pos = 2;
    int components = 0, hmax = 1, vmax = 1, have_frame = 0;

    memset(layout, 0, sizeof(*layout));
    if (size < 4 || data[0] != 0xFF || data[1] != 0xD8) {
        return 0;
    }
    while (pos + 4 <= size) {
        unsigned marker, length;
        if (data[pos] != 0xFF) {
            return 0;
        }
        marker = data[pos + 1];
        if (marker == 0xFF) { /* fill byte */
            pos++;
            continue;
        }
        length = gf_be16(data + pos + 2);
        if (length < 2 || pos + 2 + length > size) {
            return 0;
        }
        if (marker == 0xC0 || marker == 0xC1) { /* baseline / extended sequential, Huffman */
            int i;
            if (length < 8) {
                return 0;
            }
            layout->sof = pos + 5;
            layout->height = (int)gf_be16(data + pos + 5);
            layout->width = (int)gf_be16(data + pos + 7);
            components = data[pos + 9];
            if (components < 1 || length < 8 + 3u * (unsigned)components) {
                return 0;
            }
            for (i = 0; i < components; i++) {
                int h = data[pos + 11 + 3 * i] >> 4, v = data[pos + 11 + 3 * i] & 15;
                hmax = h > hmax ? h : hmax;
                vmax = v > vmax ? v : vmax;
            }
            have_frame = 1;
        } else if ((marker >= 0xC2 && marker <= 0xCF && marker != 0xC4 && marker != 0xCC) || marker == 0xDC) {
            return 0; /* progressive, lossless, arithmetic, hierarchical, DNL */
        } else if (marker == 0xDD && length == 4) {
            layout->restart = (int)gf_be16(data + pos + 4);
        } else if (marker == 0xDA) {
            if (!have_frame || length < 3 || data[pos + 4] != components || layout->height == 0) {
                return 0; /* not one interleaved scan of every component */
            }
            layout->scan = pos + 2 + length;
            break;
        }
        pos += 2 + length;
    }
    if (layout->scan == 0 || layout->restart <= 0) {
        return 0;
    }
    layout->mcu_width = components == 1 ? 8 : 8 * hmax;
    layout->mcu_height = components == 1 ? 8 : 8 * vmax;
    layout->columns = (layout->width + layout->mcu_width - 1) / layout->mcu_width;
    layout->rows = (layout->height + layout->mcu_height - 1) / layout->mcu_height;
    return layout->columns % layout->restart == 0;
}

/*
 * The JPEG of MCU columns [c0, c1) x rows [r0, r1) (c0, c1 multiples of the
 * restart interval) in a malloc'd buffer, its size in *built_size; NULL when
 * the entropy-coded data does not have the expected restart markers.
 */
static unsigned char *gf_build_rectangle(const unsigned char *data, unsigned long size,
                                         const struct gf_layout *layout, int c0, int c1, int r0, int r1,
                                         unsigned long *built_size) {
    int per_row = layout->columns / layout->restart;
    int first = (r0 * layout->columns + c0) / layout->restart, last = r1 * per_row; /* intervals [first, last) */
    int wanted = (c1 - c0) / layout->restart, interval = 0, written = 0, full_width, full_height;
    unsigned long pos = layout->scan, start = layout->scan, length = 0;
    unsigned char *out = malloc(size + 2 * (unsigned long)(r1 - r0) * (unsigned long)wanted + 4);

    if (out == NULL) {
        return NULL;
    }
    memcpy(out, data, layout->scan);
    length = layout->scan;
    full_width = c1 * layout->mcu_width < layout->width ? c1 * layout->mcu_width : layout->width;
    full_height = r1 * layout->mcu_height < layout->height ? r1 * layout->mcu_height : layout->height;
    out[layout->sof] = (unsigned char)((full_height - r0 * layout->mcu_height) >> 8);
    out[layout->sof + 1] = (unsigned char)(full_height - r0 * layout->mcu_height);
    out[layout->sof + 2] = (unsigned char)((full_width - c0 * layout->mcu_width) >> 8);
    out[layout->sof + 3] = (unsigned char)(full_width - c0 * layout->mcu_width);

    /* Walk the intervals in order: interval k runs from `start` to its marker. */
    while (interval < last) {
        const unsigned char *hit = memchr(data + pos, 0xFF, size - pos);
        unsigned next;
        if (hit == NULL || (unsigned long)(hit - data) + 1 >= size) {
            break;
        }
        pos = (unsigned long)(hit - data) + 1;
        next = data[pos];
        if (next == 0x00 || next == 0xFF) { /* stuffed byte, or fill before a marker */
            if (next == 0x00) {
                pos++;
            }
            continue;
        }
        if (next == 0xD9 ? interval != last - 1 : (next & 0xF8) != 0xD0 || (int)(next & 7) != interval % 8) {
            break; /* early end, another marker, or restarts out of sequence */
        }
        if (interval >= first && (interval - first) % per_row < wanted) {
            unsigned long end = (unsigned long)(hit - data);
            while (end > start && data[end - 1] == 0xFF) { /* fill bytes belong to the marker */
                end--;
            }
            if (written > 0) {
                out[length++] = 0xFF;
                out[length++] = (unsigned char)(0xD0 + (written - 1) % 8);
            }
            memcpy(out + length, data + start, end - start);
            length += end - start;
            written++;
        }
        pos++;
        start = pos;
        interval++;
    }
    if (interval < last) {
        free(out);
        return NULL;
    }
    out[length++] = 0xFF;
    out[length++] = 0xD9;
    *built_size = length;
    return out;
}

/*
 * Decode rows [y, y + h) and at least columns [x, x + w) of the image scaled
 * by scale_num/8 into `out` as RGBX rows of out_info[1] pixels each.
 *
 * out_info on success: [0] first decoded column (x rounded down to an iMCU
 * boundary), [1] decoded width (covers x + w).
 * Returns 0; -1 with `message` set (corrupt data, region outside the scaled
 * image, or `out_size` too small for the decoded rows); GF_UNSUPPORTED for a
 * CMYK/YCCK JPEG, which libjpeg-turbo cannot convert to RGB.
 */
static int gf_decode_rows(const unsigned char *data, unsigned long size, int scale_num, int x, int y, int w, int h,
                          unsigned char *out, unsigned long out_size, int *out_info, char *message, int message_size) {
    struct jpeg_decompress_struct cinfo;
    struct gf_error error;
    JSAMPROW rows[GF_ROWS];
    JDIMENSION xoffset, width, end;
    unsigned long stride;

    gf_setup(&cinfo, &error, message, message_size);
    if (setjmp(error.jump)) {
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, size);
    jpeg_read_header(&cinfo, TRUE);
    if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
        snprintf(message, (size_t)message_size, "CMYK JPEG: not decoded by region");
        jpeg_destroy_decompress(&cinfo);
        return GF_UNSUPPORTED;
    }
    cinfo.out_color_space = JCS_EXT_RGBX;
    cinfo.scale_num = (unsigned int)(scale_num < 1 ? 1 : (scale_num > 16 ? 16 : scale_num));
    cinfo.scale_denom = 8;
    jpeg_start_decompress(&cinfo);
    if (x < 0 || y < 0 || w < 1 || h < 1 || (JDIMENSION)(x + w) > cinfo.output_width ||
        (JDIMENSION)(y + h) > cinfo.output_height) {
        snprintf(message, (size_t)message_size, "region %dx%d+%d+%d is outside the %ux%u scaled image", w, h, x, y,
                 cinfo.output_width, cinfo.output_height);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    xoffset = (JDIMENSION)x;
    width = (JDIMENSION)w;
    if (xoffset > 0 || width < cinfo.output_width) {
        jpeg_crop_scanline(&cinfo, &xoffset, &width);
    }
    stride = (unsigned long)cinfo.output_width * 4;
    if (stride * (unsigned long)h > out_size) {
        snprintf(message, (size_t)message_size, "output buffer too small");
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    if (y > 0) {
        jpeg_skip_scanlines(&cinfo, (JDIMENSION)y);
    }
    end = (JDIMENSION)(y + h);
    while (cinfo.output_scanline < end && !error.warned) {
        JDIMENSION count = end - cinfo.output_scanline, i;
        if (count > GF_ROWS) {
            count = GF_ROWS;
        }
        for (i = 0; i < count; i++) {
            rows[i] = out + (unsigned long)(cinfo.output_scanline - (JDIMENSION)y + i) * stride;
        }
        if (jpeg_read_scanlines(&cinfo, rows, count) == 0) {
            break;
        }
    }
    out_info[0] = (int)xoffset;
    out_info[1] = (int)cinfo.output_width;
    if (cinfo.output_scanline < end && !error.warned) {
        snprintf(message, (size_t)message_size, "JPEG data ends before the region");
        error.warned = 1;
    }
    jpeg_destroy_decompress(&cinfo);
    return error.warned ? -1 : 0;
}

/* The MCU rectangle [c0, c1) x [r0, r1) holding region (x, y, w, h) of the
 * image scaled by scale/8, widened to whole restart intervals; 0 when a
 * rectangle would not save anything or the JPEG has no usable restarts. */
static int gf_plan_rectangle(const unsigned char *data, unsigned long size, int scale, int x, int y, int w, int h,
                             struct gf_layout *layout, int *rectangle) {
    int step_x, step_y, c0, c1, r0, r1;
    if (x < 0 || y < 0 || w < 1 || h < 1 || !gf_parse_layout(data, size, layout)) {
        return 0;
    }
    step_x = layout->mcu_width * scale / 8;
    step_y = layout->mcu_height * scale / 8;
    c0 = x / step_x;
    c1 = (x + w + step_x - 1) / step_x;
    r0 = y / step_y;
    r1 = (y + h + step_y - 1) / step_y;
    c0 -= c0 % layout->restart;
    c1 = (c1 + layout->restart - 1) / layout->restart * layout->restart;
    if (c1 > layout->columns || r1 > layout->rows || (c0 == 0 && c1 == layout->columns && r0 == 0)) {
        return 0;
    }
    rectangle[0] = c0, rectangle[1] = c1, rectangle[2] = r0, rectangle[3] = r1;
    rectangle[4] = c0 * step_x, rectangle[5] = r0 * step_y; /* its origin in the scaled image */
    return 1;
}

/* The small JPEG of the region's MCU rectangle (malloc'd; its size in
 * *built_size, its top-left pixel in the scaled image in origin), or NULL
 * when the whole JPEG is to be decoded. */
static unsigned char *gf_rectangle_jpeg(const unsigned char *data, unsigned long size, int scale, int x, int y, int w,
                                        int h, unsigned long *built_size, int *origin) {
    struct gf_layout layout;
    int rectangle[6];
    if (!gf_plan_rectangle(data, size, scale, x, y, w, h, &layout, rectangle)) {
        return NULL;
    }
    origin[0] = rectangle[4];
    origin[1] = rectangle[5];
    return gf_build_rectangle(data, size, &layout, rectangle[0], rectangle[1], rectangle[2], rectangle[3], built_size);
}

static int gf_clamp_scale(int scale_num) { return scale_num < 1 ? 1 : (scale_num > 16 ? 16 : scale_num); }

int gf_decode_region(const unsigned char *data, unsigned long size, int scale_num, int x, int y, int w, int h,
                     unsigned char *out, unsigned long out_size, int *out_info, char *message, int message_size) {
    int scale = gf_clamp_scale(scale_num), origin[2];
    unsigned long built_size = 0;
    unsigned char *built = gf_rectangle_jpeg(data, size, scale, x, y, w, h, &built_size, origin);

    if (built != NULL) {
        int status = gf_decode_rows(built, built_size, scale, x - origin[0], y - origin[1], w, h, out, out_size,
                                    out_info, message, message_size);
        free(built);
        out_info[0] += origin[0];
        return status;
    }
    return gf_decode_rows(data, size, scale, x, y, w, h, out, out_size, out_info, message, message_size);
}

/*
 * The JPEG that gf_decode_region would decode for this region, copied to
 * `out`; its size, 0 when the whole JPEG is decoded instead, -1 when `out`
 * is too small. origin: where its top-left pixel lies in the scaled image.
 */
long gf_region_jpeg(const unsigned char *data, unsigned long size, int scale_num, int x, int y, int w, int h,
                    unsigned char *out, unsigned long out_size, int *origin) {
    unsigned long built_size = 0;
    unsigned char *built = gf_rectangle_jpeg(data, size, gf_clamp_scale(scale_num), x, y, w, h, &built_size, origin);
    long result;

    if (built == NULL) {
        return 0;
    }
    result = built_size <= out_size ? (long)built_size : -1;
    if (result > 0) {
        memcpy(out, built, built_size);
    }
    free(built);
    return result;
}

/*
 * Many images in one call, so a decode thread gives up and takes back
 * Python's lock once per batch piece instead of twice per image: on a busy
 * loader each hand-back waits for the producer or another decode thread.
 */
void gf_header_many(int n, const unsigned char *const *data, const unsigned long *sizes, int *info, int *status) {
    int i;
    char message[8];
    for (i = 0; i < n; i++) {
        status[i] = gf_header(data[i], sizes[i], info + 4 * i, message, (int)sizeof(message));
    }
}

/* params per image: scale_num, x, y, w, h; info per image: first column, width. */
void gf_decode_region_many(int n, const unsigned char *const *data, const unsigned long *sizes, const int *params,
                           unsigned char *const *outs, const unsigned long *out_sizes, int *info, int *status,
                           char *messages, int message_size) {
    int i;
    for (i = 0; i < n; i++) {
        const int *p = params + 5 * i;
        if (outs[i] == NULL) {
            status[i] = 1; /* not asked */
            continue;
        }
        status[i] = gf_decode_region(data[i], sizes[i], p[0], p[1], p[2], p[3], p[4], outs[i], out_sizes[i],
                                     info + 2 * i, messages + (long)i * message_size, message_size);
    }
}
