/* A collective's header: what a rank publishes with a call's first step, so that every rank
 * can check that all called the same thing (collective, dtype, shape, op, root) before any data
 * is used, and name what each called when they did not.
 *
 * 76 bytes, little-endian, the layout ferro-collective's header.py packs ("<2sBBBBH8sqI6q"):
 *   0  "FC"                 8  dtype, header.py's code, NUL-padded ("<f4", "|b1", "<V2")
 *   2  collective code      16 root (int64; -1: none)
 *   3  op code (0: none)    24 sequence number (uint32: the call's ticket)
 *   4  ndim (<= 255)        28 six dims (int64); with ndim > 6 the sixth is a hash of dims 6..
 *   5  flags (1: INVALID, a refusal: its rank's arguments were wrong, and its reason's text in
 *      bytes 8..24 and 28..76 in place of dtype, root and dims; 2: UNKNOWN, a broadcast's
 *      non-root that passed no array: no dtype or shape, the root's)
 *   6  span (uint16): the tickets the rank's whole call takes when this collective is the
 *      first of several (a compressed call's: its block; ferro_opts.flags' FERRO_OPTS_SPAN),
 *      0: one; where the ranks' calls disagree, a rank whose call takes fewer gives back the
 *      difference (ferro_comm_catch_up), so that the calls after it keep one order
 * No Python: the door encodes its calls' headers here, and describes them in its messages.
 */
#ifndef FERRO_HEADER_H
#define FERRO_HEADER_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "ferro/engine.h"

#define FERRO_HEADER_BYTES 76u
#define FERRO_HEADER_DIMS 6
/* where a header holds its sequence number */
#define FERRO_SEQ_OFF 24u
/* header flag: this rank's arguments were invalid (a refusal, with its reason) */
#define FERRO_HEADER_INVALID 1u
/* header flag: a broadcast's non-root that passed no array (no dtype, no shape) */
#define FERRO_HEADER_UNKNOWN 2u
/* where a header holds its span (uint16, little-endian) */
#define FERRO_SPAN_OFF 6u
/* bytes of a refusal's reason: 8..24 and 28..76 */
#define FERRO_REASON_BYTES 64u

/* the collectives' codes (header.py's COLLECTIVES) */
enum {
    FERRO_COLL_BARRIER = 1, FERRO_COLL_ALLREDUCE = 2, FERRO_COLL_BROADCAST = 3,
    FERRO_COLL_ALL_GATHER = 4, FERRO_COLL_REDUCE_SCATTER = 5, FERRO_COLL_REDUCE = 6,
    FERRO_COLL_GATHER = 7, FERRO_COLL_SCATTER = 8, FERRO_COLL_ALL_GATHER_V = 9,
    FERRO_COLL_ALL_TO_ALL = 10, FERRO_COLL_ALL_TO_ALL_SINGLE = 11,
    FERRO_COLL_BROADCAST_OBJECT = 12, FERRO_COLL_ALL_GATHER_OBJECT = 13, FERRO_COLL_COUNT = 14
};

static const char* const FERRO_COLL_NAMES[FERRO_COLL_COUNT] = {
    NULL, "barrier", "allreduce", "broadcast", "all_gather", "reduce_scatter", "reduce",
    "gather", "scatter", "all_gather_v", "all_to_all", "all_to_all_single", "broadcast_object",
    "all_gather_object"};

/* an op's code in a header (never 0, which means "no op"), and its name there */
static const uint8_t FERRO_OP_WIRE[FERRO_OP_COUNT] = {1, 5, 3, 4, 6, 7, 8, 2};
static const char* const FERRO_WIRE_OP_NAMES[9] = {NULL, "SUM", "MEAN", "MAX", "MIN", "PRODUCT",
                                                   "BAND", "BOR", "BXOR"};

/* numpy's dtype.str of each ferro_dtype on a little-endian host, and its name */
static const char* const FERRO_DTYPE_STR[FERRO_DTYPE_COUNT] = {
    "<f4", "<f8", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "<f2", "<V2", "|b1"};
static const char* const FERRO_DTYPE_NAMES[FERRO_DTYPE_COUNT] = {
    "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
    "uint64", "float16", "bfloat16", "bool"};

/* the codes header.py gives ml_dtypes' types (its EXTENSION_DTYPES, part of the wire format:
 * "<V2" is bfloat16's, above), and their names */
#define FERRO_EXT_DTYPE_COUNT 19
static const char* const FERRO_EXT_DTYPE_CODES[FERRO_EXT_DTYPE_COUNT][2] = {
    {"f8e3m4", "float8_e3m4"}, {"f8e4m3", "float8_e4m3"}, {"f8e4m3bz", "float8_e4m3b11fnuz"},
    {"f8e4m3fn", "float8_e4m3fn"}, {"f8e4m3fz", "float8_e4m3fnuz"}, {"f8e5m2", "float8_e5m2"},
    {"f8e5m2fz", "float8_e5m2fnuz"}, {"f8e8m0fu", "float8_e8m0fnu"},
    {"f6e2m3fn", "float6_e2m3fn"}, {"f6e3m2fn", "float6_e3m2fn"},
    {"f4e2m1fn", "float4_e2m1fn"}, {"int1", "int1"}, {"int2", "int2"}, {"int4", "int4"},
    {"uint1", "uint1"}, {"uint2", "uint2"}, {"uint4", "uint4"}, {"c32", "complex32"},
    {"bc32", "bcomplex32"}};

static inline void ferro_put_u32(unsigned char* p, uint32_t v) {
    int i;
    for (i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static inline void ferro_put_i64(unsigned char* p, int64_t v) {
    uint64_t u = (uint64_t)v;
    int i;
    for (i = 0; i < 8; i++) p[i] = (unsigned char)(u >> (8 * i));
}

static inline uint32_t ferro_get_u32(const unsigned char* p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline int64_t ferro_get_i64(const unsigned char* p) {
    uint64_t u = 0;
    int i;
    for (i = 7; i >= 0; i--) u = (u << 8) | p[i];
    return (int64_t)u;
}

/* the sixth dim of a header whose shape has more than six: FNV-1a (64 bits) over the
 * little-endian bytes of dims 5.., masked to 63 bits (header.py computes the same) */
static inline int64_t ferro_dims_tail_hash(const int64_t* dims, int ndim) {
    uint64_t x = 14695981039346656037ull, u;
    int d, i;
    for (d = FERRO_HEADER_DIMS - 1; d < ndim; d++) {
        u = (uint64_t)dims[d];
        for (i = 0; i < 8; i++) x = (x ^ ((u >> (8 * i)) & 0xFFu)) * 1099511628211ull;
    }
    return (int64_t)(x & 0x7FFFFFFFFFFFFFFFull);
}

/* The header of a call: collective coll, dtype (-1: none, as a barrier; type_name, if not NULL,
 * names another), shape (ndim dims), op (-1: none), root (-1: none), sequence number seq,
 * the tickets its whole call takes (span; 0: one). */
static inline void ferro_header_encode(unsigned char* h, int coll, int dtype,
                                       const char* type_name, int ndim, const int64_t* dims,
                                       int op, int64_t root, uint32_t seq, unsigned flags,
                                       unsigned span) {
    int d;
    memset(h, 0, FERRO_HEADER_BYTES);
    h[0] = 'F';
    h[1] = 'C';
    h[2] = (unsigned char)coll;
    h[3] = op >= 0 && op < FERRO_OP_COUNT ? FERRO_OP_WIRE[op] : 0;
    h[4] = (unsigned char)(ndim > 255 ? 255 : ndim);
    h[5] = (unsigned char)flags;
    h[FERRO_SPAN_OFF] = (unsigned char)(span & 0xFFu);
    h[FERRO_SPAN_OFF + 1] = (unsigned char)((span >> 8) & 0xFFu);
    if (type_name != NULL && dtype >= 0)
        memcpy(h + 8, type_name, strnlen(type_name, 8));
    else if (dtype >= 0 && dtype < FERRO_DTYPE_COUNT)
        memcpy(h + 8, FERRO_DTYPE_STR[dtype], strlen(FERRO_DTYPE_STR[dtype]));
    ferro_put_i64(h + 16, root);
    ferro_put_u32(h + FERRO_SEQ_OFF, seq);
    for (d = 0; d < ndim && d < FERRO_HEADER_DIMS; d++) ferro_put_i64(h + 28 + 8 * d, dims[d]);
    if (ndim > FERRO_HEADER_DIMS)
        ferro_put_i64(h + 28 + 8 * (FERRO_HEADER_DIMS - 1), ferro_dims_tail_hash(dims, ndim));
}

/* the tickets the call whose header is h takes (its span; 0 there: one) */
static inline int64_t ferro_header_span(const unsigned char* h) {
    unsigned span = (unsigned)h[FERRO_SPAN_OFF] | ((unsigned)h[FERRO_SPAN_OFF + 1] << 8);
    return span ? (int64_t)span : 1;
}

/* out (len bytes) = a refusal's reason (NUL-terminated; at most FERRO_REASON_BYTES chars) */
static inline void ferro_header_reason(const unsigned char* h, char* out, size_t len) {
    char text[FERRO_REASON_BYTES + 1];
    memcpy(text, h + 8, 16);
    memcpy(text + 16, h + 28, FERRO_REASON_BYTES - 16);
    text[FERRO_REASON_BYTES] = '\0';
    snprintf(out, len, "%s", text);
}

/* out (len bytes) = what the header says its rank called, as header.py's describe says it:
 * "allreduce(float32[4, 8], SUM) (seq 3)" */
static inline void ferro_header_describe(const unsigned char* h, size_t hlen, char* out,
                                         size_t len) {
    char dt[9], args[400];
    const char* name;
    size_t at = 0;
    int coll, d, ndim, k, tail;
    int64_t root;
    uint32_t seq;
    if (len == 0) return;
    out[0] = '\0';
    if (hlen < FERRO_HEADER_BYTES || h[0] != 'F' || h[1] != 'C') {
        snprintf(out, len, "<not a ferro collective header>");
        return;
    }
    coll = h[2];
    seq = ferro_get_u32(h + FERRO_SEQ_OFF);
    name = coll > 0 && coll < FERRO_COLL_COUNT ? FERRO_COLL_NAMES[coll] : NULL;
    if (coll == FERRO_COLL_BARRIER) {
        snprintf(out, len, "barrier (seq %u)", seq);
        return;
    }
    if (h[5] & FERRO_HEADER_INVALID) {
        ferro_header_reason(h, args, sizeof args);
        snprintf(out, len, "%s(<refused: %s>) (seq %u)", name ? name : "op#?", args, seq);
        return;
    }
    if (h[5] & FERRO_HEADER_UNKNOWN) {
        snprintf(out, len, "%s(None, root=%lld) (seq %u)", name ? name : "op#?",
                 (long long)ferro_get_i64(h + 16), seq);
        return;
    }
    memcpy(dt, h + 8, 8);
    dt[8] = '\0';
    args[0] = '\0';
    if (dt[0] != '\0') {
        const char* dname = dt;
        for (k = 0; k < FERRO_DTYPE_COUNT; k++)
            if (strcmp(dt, FERRO_DTYPE_STR[k]) == 0) dname = FERRO_DTYPE_NAMES[k];
        for (k = 0; k < FERRO_EXT_DTYPE_COUNT; k++)
            if (strcmp(dt, FERRO_EXT_DTYPE_CODES[k][0]) == 0)
                dname = FERRO_EXT_DTYPE_CODES[k][1];
        at += (size_t)snprintf(args + at, sizeof args - at, "%s[", dname);
        ndim = h[4] < FERRO_HEADER_DIMS ? h[4] : FERRO_HEADER_DIMS;
        tail = h[4] > FERRO_HEADER_DIMS;  /* (the last dim's place holds a hash of the rest) */
        for (d = 0; d < ndim - tail && at < sizeof args; d++) {
            int64_t v = ferro_get_i64(h + 28 + 8 * d);
            if (v >= 0)
                at += (size_t)snprintf(args + at, sizeof args - at, "%s%lld", d ? ", " : "",
                                       (long long)v);
            else
                at += (size_t)snprintf(args + at, sizeof args - at, "%s*", d ? ", " : "");
        }
        if (tail && at < sizeof args)
            at += (size_t)snprintf(args + at, sizeof args - at, ", ... (%d dims)", (int)h[4]);
        if (at < sizeof args) at += (size_t)snprintf(args + at, sizeof args - at, "]");
    }
    if (h[3] != 0 && at < sizeof args)
        at += (size_t)snprintf(args + at, sizeof args - at, "%s%s", at ? ", " : "",
                               h[3] < 9 ? FERRO_WIRE_OP_NAMES[h[3]] : "op#?");
    root = ferro_get_i64(h + 16);
    if (root >= 0 && at < sizeof args)
        snprintf(args + at, sizeof args - at, "%sroot=%lld", at ? ", " : "", (long long)root);
    if (name != NULL)
        snprintf(out, len, "%s(%s) (seq %u)", name, args, seq);
    else
        snprintf(out, len, "op#%d(%s) (seq %u)", coll, args, seq);
}

#endif
