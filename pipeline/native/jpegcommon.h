/*
 * libjpeg error handling shared by jpegregion.c and ycc.c: errors jump back
 * to the caller with libjpeg's message kept, and the first warning (corrupt
 * data that libjpeg would paper over with grey) is kept and flagged.
 */

#ifndef GPUFEED_JPEGCOMMON_H
#define GPUFEED_JPEGCOMMON_H

#include <setjmp.h>
#include <stdio.h>

#include <jpeglib.h>

struct gf_error {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char *message;
    int message_size;
    int warned;
};

/* Keep libjpeg's text for the message it is about to act on. */
static inline void gf_keep_message(j_common_ptr cinfo) {
    struct gf_error *error = (struct gf_error *)cinfo->err;
    char text[JMSG_LENGTH_MAX];
    (*cinfo->err->format_message)(cinfo, text);
    if (error->message != NULL && error->message_size > 0) {
        snprintf(error->message, (size_t)error->message_size, "%s", text);
    }
}

static inline void gf_error_exit(j_common_ptr cinfo) {
    gf_keep_message(cinfo);
    longjmp(((struct gf_error *)cinfo->err)->jump, 1);
}

/* Trace messages are dropped; the first warning is kept. */
static inline void gf_emit_message(j_common_ptr cinfo, int level) {
    struct gf_error *error = (struct gf_error *)cinfo->err;
    if (level < 0 && !error->warned) {
        gf_keep_message(cinfo);
        error->warned = 1;
    }
}

/* The error manager to put in cinfo->err (decompress or compress). */
static inline struct jpeg_error_mgr *gf_error_init(struct gf_error *error, char *message, int size) {
    struct jpeg_error_mgr *pub = jpeg_std_error(&error->pub);
    error->pub.error_exit = gf_error_exit;
    error->pub.emit_message = gf_emit_message;
    error->message = message;
    error->message_size = size;
    error->warned = 0;
    if (message != NULL && size > 0) {
        message[0] = '\0';
    }
    return pub;
}

#endif
