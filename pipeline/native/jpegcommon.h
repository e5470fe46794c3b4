/*
 * libjpeg error handling shared by jpegregion.c and ycc.c: errors jump back
 * to the caller with libjpeg's message kept, and the first warning (corrupt
 * data that libjpeg would paper over with grey) is kept and flagged. With
 * `collect` set (gf_jpeg_warnings) every distinct warning is kept instead,
 * one a line, and counted.
 */

#ifndef GPUFEED_JPEGCOMMON_H
#define GPUFEED_JPEGCOMMON_H

#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

struct gf_error {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char *message;
    int message_size;
    int warned;  /* warnings seen: 0 or 1, or every one with `collect` */
    int collect; /* keep every distinct warning, not only the first */
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

/* Add libjpeg's text for this warning to the message as a line of its own,
 * unless that line is there already or would not fit. */
static inline void gf_add_warning(j_common_ptr cinfo) {
    struct gf_error *error = (struct gf_error *)cinfo->err;
    char text[JMSG_LENGTH_MAX];
    if (error->message == NULL || error->message_size <= 0) {
        return;
    }
    (*cinfo->err->format_message)(cinfo, text);
    size_t length = strlen(text), used = strlen(error->message);
    for (const char *line = error->message; *line != '\0';) {
        const char *end = strchr(line, '\n');
        size_t size = end != NULL ? (size_t)(end - line) : strlen(line);
        if (size == length && memcmp(line, text, length) == 0) {
            return;
        }
        line += size + (end != NULL);
    }
    size_t separator = used > 0 ? 1 : 0;
    if (used + separator + length + 1 > (size_t)error->message_size) {
        return;
    }
    if (separator) {
        error->message[used++] = '\n';
    }
    memcpy(error->message + used, text, length + 1);
}

/* Trace messages are dropped; the first warning is kept (every one with `collect`). */
static inline void gf_emit_message(j_common_ptr cinfo, int level) {
    struct gf_error *error = (struct gf_error *)cinfo->err;
    if (level >= 0) {
        return;
    }
    if (error->collect) {
        gf_add_warning(cinfo);
        error->warned++;
    } else if (!error->warned) {
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
    error->collect = 0;
    if (message != NULL && size > 0) {
        message[0] = '\0';
    }
    return pub;
}

#endif
