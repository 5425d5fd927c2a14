/* Cropped JPEG decode with libjpeg-turbo: decode only the rows and columns a crop needs.
 *
 * decode_crop(data, x0, y0, x1, y1, denom[, out]) -> (pixels: bytes, width, height, left, top)
 *   (x0, y0, x1, y1): the crop in the coordinates of the image scaled by 1/denom (denom in 1, 2, 4, 8).
 *   Rows above the crop are skipped (jpeg_skip_scanlines: entropy-decoded, not IDCT'd), rows below it are
 *   never decoded, and columns are limited to the crop rounded out to iMCU boundaries (jpeg_crop_scanline).
 *   Returns RGB rows of `width` pixels covering columns [left, left + width) and rows [top, top + height) of
 *   the scaled image; the caller takes its exact crop from them.
 *   With `out` (a writable C-contiguous buffer) the rows are written there, packed, and pixels is None;
 *   when they need more than len(out) bytes nothing is written and None is returned.
 *
 * Strict: any libjpeg warning (corrupt or truncated data) raises ValueError, as simplejpeg(strict=True) does.
 *
 * entropy_ok(data, start, end) -> bool
 *   Whether data[start:end], a scan's entropy-coded bytes, holds 0xFF only as stuffed bytes (FF 00), restart
 *   markers (FF D0-D7) or fill (FF FF), and does not end on 0xFF: jpeg_check.gpu_safe_jpeg's scan test,
 *   about 6x faster than its numpy form (memchr finds the few 0xFF bytes). Releases the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h>
#include <string.h>
#include <jpeglib.h>

struct strict_error_mgr {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};

static void strict_error_exit(j_common_ptr cinfo) {
    struct strict_error_mgr *err = (struct strict_error_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void strict_emit_message(j_common_ptr cinfo, int level) {
    if (level < 0) { /* a warning: corrupt data; refuse rather than deliver damaged pixels */
        strict_error_exit(cinfo);
    }
}

/* Everything decode_crop holds, let go on every way out. */
static void release(struct jpeg_decompress_struct *cinfo, Py_buffer *data, Py_buffer *dest, int into) {
    jpeg_destroy_decompress(cinfo);
    PyBuffer_Release(data);
    if (into) PyBuffer_Release(dest);
}

static PyObject *decode_crop(PyObject *self, PyObject *args) {
    Py_buffer data, dest;
    int x0, y0, x1, y1, denom;
    PyObject *target = Py_None;
    if (!PyArg_ParseTuple(args, "y*iiiii|O", &data, &x0, &y0, &x1, &y1, &denom, &target)) return NULL;
    int into = target != Py_None;
    if (into && PyObject_GetBuffer(target, &dest, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
        PyBuffer_Release(&data);
        return NULL;
    }

    struct jpeg_decompress_struct cinfo;
    struct strict_error_mgr jerr;
    PyObject *volatile out = NULL; /* assigned after setjmp: volatile so the error path sees it */
    cinfo.err = jpeg_std_error(&jerr.pub);
    jerr.pub.error_exit = strict_error_exit;
    jerr.pub.emit_message = strict_emit_message;
    jerr.message[0] = 0;
    if (setjmp(jerr.jump)) {
        Py_XDECREF(out);
        release(&cinfo, &data, &dest, into);
        PyErr_Format(PyExc_ValueError, "libjpeg-turbo: %s", jerr.message);
        return NULL;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, (const unsigned char *)data.buf, (unsigned long)data.len);
    jpeg_read_header(&cinfo, TRUE);
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)denom;
    jpeg_start_decompress(&cinfo);

    int W = (int)cinfo.output_width, H = (int)cinfo.output_height;
    if (x0 < 0) x0 = 0;
    if (y0 < 0) y0 = 0;
    if (x1 > W) x1 = W;
    if (y1 > H) y1 = H;
    if (x1 <= x0 || y1 <= y0) {
        release(&cinfo, &data, &dest, into);
        PyErr_Format(PyExc_ValueError, "empty crop (%d, %d, %d, %d) of a %dx%d image", x0, y0, x1, y1, W, H);
        return NULL;
    }
    JDIMENSION left = (JDIMENSION)x0, width = (JDIMENSION)(x1 - x0);
    jpeg_crop_scanline(&cinfo, &left, &width);
    if (y0 > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)y0);
    int height = y1 - y0;
    Py_ssize_t stride = (Py_ssize_t)width * 3;
    unsigned char *dst;
    if (into) {
        if (stride * height > dest.len) { /* does not fit: the caller decodes another way */
            release(&cinfo, &data, &dest, into);
            Py_RETURN_NONE;
        }
        dst = (unsigned char *)dest.buf;
    } else {
        out = PyBytes_FromStringAndSize(NULL, stride * height);
        if (out == NULL) longjmp(jerr.jump, 1);
        dst = (unsigned char *)PyBytes_AS_STRING(out);
    }
    int done = 0;
    /* The GIL is kept: errors leave through longjmp, and workers are single-threaded processes anyway. */
    while (done < height) {
        JSAMPROW row = dst + (Py_ssize_t)done * stride;
        if (jpeg_read_scanlines(&cinfo, &row, 1) != 1) break;
        done++;
    }
    if (done < height) {
        snprintf(jerr.message, sizeof jerr.message, "read %d of %d rows", done, height);
        longjmp(jerr.jump, 1);
    }
    jpeg_abort_decompress(&cinfo); /* the rows below the crop are not needed */
    release(&cinfo, &data, &dest, into);
    return Py_BuildValue("(Niiii)", into ? Py_NewRef(Py_None) : out, (int)width, height, (int)left, y0);
}

static PyObject *entropy_ok(PyObject *self, PyObject *args) {
    Py_buffer data;
    Py_ssize_t start, end;
    if (!PyArg_ParseTuple(args, "y*nn", &data, &start, &end)) return NULL;
    if (start < 0 || end > data.len || start > end) {
        PyBuffer_Release(&data);
        PyErr_Format(PyExc_ValueError, "range [%zd, %zd) outside the %zd bytes given", start, end, data.len);
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)data.buf + start;
    const unsigned char *stop = (const unsigned char *)data.buf + end;
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    while (p < stop) {
        const unsigned char *ff = memchr(p, 0xFF, (size_t)(stop - p));
        if (ff == NULL) break;
        if (ff + 1 >= stop) { ok = 0; break; }  /* ends inside a marker */
        unsigned char next = ff[1];
        if (!(next == 0x00 || next == 0xFF || (next >= 0xD0 && next <= 0xD7))) { ok = 0; break; }
        p = ff + 1;  /* after FF FF the second FF is checked in turn */
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"decode_crop", decode_crop, METH_VARARGS, "Decode only a crop of a JPEG (see the module source)."},
    {"entropy_ok", entropy_ok, METH_VARARGS, "Check a scan's entropy-coded bytes (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_turbo_crop", NULL, -1, methods};

PyMODINIT_FUNC PyInit__turbo_crop(void) { return PyModule_Create(&module); }
