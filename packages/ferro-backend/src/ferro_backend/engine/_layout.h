/* The same-host engine's shared segment, declared once.
 *
 * Every kernel that touches the segment (_segment, _slots, _ring) includes this header, and
 * Python reads the offsets it needs from _segment.layout(), computed here: nothing else knows
 * where a word lives. The segment, for n ranks:
 *
 *   [0, 128)                       ferro_seg_head
 *   ctrl_off + r * 128             rank r's ferro_ctrl (two cache lines: no false sharing)
 *   slot_off + r * slot_stride     rank r's two slots (by step parity, parity_stride apart):
 *                                  a ferro_slot_head, then slot_bytes of data
 *   ring_off + (d*n + s) * ring_stride
 *                                  the point-to-point ring from s to d: a ferro_ring_ctrl, then
 *                                  ring_bytes of ferro_ring_entry records and their payloads
 *                                  (ferro's Python messages: rings.py)
 *   door_ring_off + (d*n + s) * ring_stride
 *                                  the same for the door's point-to-point calls (door_p2p.c)
 *
 * Control lines, slots and rings start on page boundaries where it matters.
 */
#ifndef FERRO_LAYOUT_H
#define FERRO_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#define FERRO_MAGIC 0xFE770E61u
#define FERRO_SEGMENT_VERSION 10u
#define FERRO_PAGE 4096u
/* the room a collective header has at the start of a slot */
#define FERRO_HEADER_ROOM 128u

typedef struct {               /* the segment's first 128 bytes, written by rank 0 */
    uint32_t magic, version, nranks, reserved;
    uint64_t slot_bytes, ring_bytes;
    uint64_t split_bytes;      /* the split allreduce's threshold (rank 0's setting holds) */
    double link_rtt_ns;        /* the link probe's results (_probe.h), stamped by rank 0 */
    double link_copy_gbps;
    double link_at;            /*   when it ran (seconds since the epoch) */
    uint32_t probes;           /*   and how many probes the segment has run */
    uint32_t pad4;
    uint8_t pad[56];
} ferro_seg_head;

typedef struct {               /* one per rank */
    uint32_t step;             /* the last collective step this rank published */
    uint32_t sleepers;         /* futex waiters on step */
    uint64_t pid;              /* this rank's process */
    uint64_t probe;            /* address of a word peers read to test cross-memory copies */
    uint64_t link;             /* the link probe's ping (rank 0) or answer (others): _probe.h */
    uint32_t bell;             /* point-to-point doorbell: producers about to sleep ring it */
    uint32_t reserved2;
    uint64_t head_hash[2];     /* the hash of this rank's collective header, by step parity */
    int64_t reprobe;           /* rank 0: the ticket + 1 of the call before which every rank
                                * probes the link again (door.c; 0: none), written before the
                                * first step of the call before it is published */
    /* the split reduction's progress (_split.h), on the second line: chunks ever copied in,
     * chunks ever folded, chunks ever gathered (mod 2**32), and their futex sleepers */
    uint32_t inprog, in_sleepers, outprog, out_sleepers, gprog, g_sleepers;
    uint8_t pad2[40];
} ferro_ctrl;

typedef struct {               /* the start of each slot; slot_bytes of data follow */
    uint8_t header[FERRO_HEADER_ROOM];  /* the step's collective header (the consumer's) */
    uint64_t pid, in_addr, out_addr;    /* where peers may read this rank's buffers */
    uint32_t in_base, out_base, g_base; /* a split step's progress counters at its start */
    uint8_t pad[92];
} ferro_slot_head;

typedef struct {               /* a single-producer, single-consumer ring's control block */
    uint32_t head;             /* bytes ever written, mod 2**32 (the producer's) */
    uint32_t head_sleepers;    /* consumers asleep on head */
    uint8_t pad0[56];
    uint32_t tail;             /* bytes ever consumed, mod 2**32 (the consumer's) */
    uint32_t tail_sleepers;    /* producers asleep on tail */
    uint8_t pad1[56];
} ferro_ring_ctrl;

typedef struct {               /* a ring entry's header; its payload follows, 64-byte aligned */
    uint32_t kind;             /* FERRO_PAD, FERRO_EAGER, FERRO_CHUNK or FERRO_CMA */
    uint32_t len;              /* payload bytes (a CMA entry: the status its consumer writes) */
    uint64_t tag, total;       /* the message's tag and size */
    uint64_t aux;              /* a chunk's offset in its message; a CMA entry's address */
} ferro_ring_entry;

enum { FERRO_PAD = 1, FERRO_EAGER = 2, FERRO_CHUNK = 3, FERRO_CMA = 4 };

_Static_assert(sizeof(ferro_seg_head) == 128, "the segment header is 128 bytes");
_Static_assert(sizeof(ferro_ctrl) == 128, "a control line is two cache lines");
_Static_assert(offsetof(ferro_ctrl, bell) == 32, "the doorbell sits at byte 32");
_Static_assert(offsetof(ferro_ctrl, head_hash) == 40, "header hashes on the step's line");
_Static_assert(offsetof(ferro_ctrl, reprobe) == 56, "the re-probe request on the step's line");
_Static_assert(offsetof(ferro_ctrl, inprog) == 64, "split progress on the second line");
_Static_assert(sizeof(ferro_slot_head) == 256, "a slot head is 256 bytes");
_Static_assert(sizeof(ferro_ring_ctrl) == 128, "a ring's control block is 128 bytes");
_Static_assert(offsetof(ferro_ring_ctrl, tail) == 64, "head and tail on their own lines");
_Static_assert(sizeof(ferro_ring_entry) == 32, "a ring entry's header is 32 bytes");

typedef struct {
    int nranks;
    size_t slot_bytes, ring_bytes;
    size_t ctrl_off, slot_off, slot_stride, parity_stride, ring_off, ring_stride, door_ring_off;
    size_t size;
} ferro_layout;

static inline size_t ferro_align(size_t n, size_t to) { return (n + to - 1) / to * to; }

static inline void ferro_layout_init(ferro_layout* L, int n, size_t slot_bytes,
                                     size_t ring_bytes) {
    L->nranks = n;
    L->slot_bytes = slot_bytes;
    L->ring_bytes = ring_bytes;
    L->ctrl_off = sizeof(ferro_seg_head);
    L->slot_off = ferro_align(L->ctrl_off + (size_t)n * sizeof(ferro_ctrl), FERRO_PAGE);
    L->parity_stride = ferro_align(sizeof(ferro_slot_head) + slot_bytes, FERRO_PAGE);
    L->slot_stride = 2 * L->parity_stride;
    L->ring_off = L->slot_off + (size_t)n * L->slot_stride;
    L->ring_stride = ferro_align(sizeof(ferro_ring_ctrl) + ring_bytes, FERRO_PAGE);
    L->door_ring_off = L->ring_off + (size_t)n * (size_t)n * L->ring_stride;
    L->size = L->door_ring_off + (size_t)n * (size_t)n * L->ring_stride;
}

static inline ferro_seg_head* ferro_head_of(unsigned char* base) {
    return (ferro_seg_head*)base;
}

static inline ferro_ctrl* ferro_ctrl_of(unsigned char* base, const ferro_layout* L, int rank) {
    return (ferro_ctrl*)(base + L->ctrl_off + (size_t)rank * sizeof(ferro_ctrl));
}

static inline ferro_slot_head* ferro_slot_of(unsigned char* base, const ferro_layout* L,
                                             int rank, uint32_t step) {
    return (ferro_slot_head*)(base + L->slot_off + (size_t)rank * L->slot_stride
                              + (size_t)(step & 1u) * L->parity_stride);
}

static inline unsigned char* ferro_slot_data(ferro_slot_head* slot) {
    return (unsigned char*)(slot + 1);
}

static inline ferro_ring_ctrl* ferro_ring_of(unsigned char* base, const ferro_layout* L,
                                             int src, int dst) {
    return (ferro_ring_ctrl*)(base + L->ring_off
                              + ((size_t)dst * (size_t)L->nranks + (size_t)src) * L->ring_stride);
}

/* the door's point-to-point ring from src to dst */
static inline ferro_ring_ctrl* ferro_door_ring_of(unsigned char* base, const ferro_layout* L,
                                                  int src, int dst) {
    return (ferro_ring_ctrl*)(base + L->door_ring_off
                              + ((size_t)dst * (size_t)L->nranks + (size_t)src) * L->ring_stride);
}

static inline unsigned char* ferro_ring_data(ferro_ring_ctrl* ring) {
    return (unsigned char*)(ring + 1);
}

#endif
