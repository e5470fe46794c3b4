/*
 * The module shell of the library that `pip install` builds
 * (pipeline.native._libgpufeed): an empty Python module, so the file is a
 * valid extension module wherever Python looks at it, around the C code that
 * gpufeed calls through ctypes. It also records the digest of the sources it
 * was built from (GF_SOURCE_DIGEST, set by build.py), so that an in-place
 * build left over from older sources is never loaded.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "gpufeed.h"

#ifndef GF_SOURCE_DIGEST
#error "build.py defines GF_SOURCE_DIGEST"
#endif

const char *gf_source_digest(void) { return GF_SOURCE_DIGEST; }

static struct PyModuleDef gf_module = {
    PyModuleDef_HEAD_INIT, "_libgpufeed", "gpufeed's native code, called through ctypes (see bindings.py).", -1, NULL,
};

PyMODINIT_FUNC PyInit__libgpufeed(void) { return PyModule_Create(&gf_module); }
