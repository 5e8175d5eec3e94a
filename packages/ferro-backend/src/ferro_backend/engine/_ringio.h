/* One end of a point-to-point ring of the segment (_layout.h: ferro_ring_ctrl and its entries):
 * the producer's and the consumer's moves, written once.
 *
 * An entry is a 32-byte ferro_ring_entry header and its payload, 64-byte aligned; an entry
 * never wraps: a PAD entry fills the end of the data area instead. The producer (one at a time:
 * its caller holds a per-ring lock) waits for space, writes the entry and publishes head; the
 * consumer (likewise) reads the entry at tail and publishes the new tail. Waits are _sync.h's;
 * a producer about to sleep first rings the consumer's doorbell (a Watch drains a ring nobody
 * else is draining). _ring.pyx (ferro's Python messages, rings.py) and the door's
 * point-to-point calls (door_p2p.c, on rings of their own) both move bytes with these.
 */
#ifndef FERRO_RINGIO_H
#define FERRO_RINGIO_H

#include <stdint.h>
#include <string.h>

#include "_layout.h"
#include "_sync.h"

typedef struct {
    ferro_ring_ctrl* ctrl;
    unsigned char* data;
    uint32_t* failed;          /* this process's failure flag */
    uint32_t* bell;            /* the consumer's doorbell */
    uint32_t cap, mask;        /* data bytes (a power of two) */
    ferro_policy pol;
} ferro_ring_io;

/* bytes an entry of n payload bytes takes in the ring */
static inline uint32_t ferro_entry_bytes(uint32_t n) { return (32u + n + 63u) & ~(uint32_t)63u; }

/* the largest payload one entry may carry (a quarter of the ring, less its header) */
static inline uint32_t ferro_ring_max_payload(const ferro_ring_io* io) {
    return io->cap / 4u - 32u;
}

/* the ring `ctrl` (data bytes `cap`), consumed by the rank whose doorbell is `bell` */
static inline void ferro_ring_io_init(ferro_ring_io* io, ferro_ring_ctrl* ctrl, uint32_t cap,
                                      uint32_t* bell, uint32_t* failed, int spin, int yields) {
    io->ctrl = ctrl;
    io->data = ferro_ring_data(ctrl);
    io->cap = cap;
    io->mask = cap - 1u;
    io->bell = bell;
    io->failed = failed;
    io->pol.spin = spin;
    io->pol.yields = yields;
}

/* Wait for the tail (a producer: it rings the doorbell before it sleeps; it spins until
 * busy_until first) or the head (a consumer) to move from `seen`. */
static inline int ferro_ring_wait(ferro_ring_io* io, int on_tail, uint32_t seen, double until,
                                  int watch_failed, double busy_until) {
    if (on_tail)
        return ferro_wait(&io->pol, &io->ctrl->tail, seen, FERRO_UNTIL_CHANGED,
                          &io->ctrl->tail_sleepers, until, watch_failed ? io->failed : NULL,
                          io->bell, busy_until);
    return ferro_wait(&io->pol, &io->ctrl->head, seen, FERRO_UNTIL_CHANGED,
                      &io->ctrl->head_sleepers, until, watch_failed ? io->failed : NULL, NULL,
                      0.0);
}

static inline void ferro_ring_publish_head(ferro_ring_io* io, uint32_t pos) {
    ferro_publish(&io->ctrl->head, pos, &io->ctrl->head_sleepers);
}

static inline void ferro_ring_publish_tail(ferro_ring_io* io, uint32_t pos) {
    ferro_publish(&io->ctrl->tail, pos, &io->ctrl->tail_sleepers);
}

/* producer: wait until `need` bytes from position pos are free */
static inline int ferro_ring_wait_space(ferro_ring_io* io, uint32_t pos, uint32_t need,
                                        double until, int watch_failed) {
    uint32_t t;
    int rc;
    for (;;) {
        t = ferro_load(&io->ctrl->tail);
        if (pos + need - t <= io->cap) return FERRO_OK;
        rc = ferro_ring_wait(io, 1, t, until, watch_failed, 0.0);
        if (rc != FERRO_OK) return rc;
    }
}

/* producer: append one entry of n <= ferro_ring_max_payload bytes, waiting for space; its
 * ring position goes to *start */
static inline int ferro_ring_put(ferro_ring_io* io, uint32_t kind, uint64_t tag, uint64_t total,
                                 uint64_t aux, const unsigned char* src, uint32_t n,
                                 double until, int watch_failed, uint32_t* start) {
    uint32_t need = ferro_entry_bytes(n), pos, room;
    int rc;
    ferro_ring_entry* e;
    pos = ferro_load(&io->ctrl->head);
    room = io->cap - (pos & io->mask);
    if (room < need) {  /* the entry would wrap: pad the end of the data area */
        rc = ferro_ring_wait_space(io, pos, room, until, watch_failed);
        if (rc != FERRO_OK) return rc;
        e = (ferro_ring_entry*)(void*)(io->data + (pos & io->mask));
        e->kind = FERRO_PAD;
        e->len = room - 32u;
        pos += room;
        ferro_ring_publish_head(io, pos);
    }
    rc = ferro_ring_wait_space(io, pos, need, until, watch_failed);
    if (rc != FERRO_OK) return rc;
    e = (ferro_ring_entry*)(void*)(io->data + (pos & io->mask));
    e->kind = kind;
    e->len = n;
    e->tag = tag;
    e->total = total;
    e->aux = aux;
    if (n) memcpy((unsigned char*)e + 32, src, n);
    *start = pos;
    ferro_ring_publish_head(io, pos + need);
    return FERRO_OK;
}

/* consumer: the entry at tail (skipping padding), or NULL if the ring is empty. A padding
 * entry that runs past the published head (no producer writes one: the segment is corrupt)
 * is returned as it is, for the caller to refuse, rather than skipped round the ring */
static inline ferro_ring_entry* ferro_ring_head(ferro_ring_io* io) {
    uint32_t t = ferro_load(&io->ctrl->tail), skip;
    ferro_ring_entry* e;
    while (t != ferro_load(&io->ctrl->head)) {
        e = (ferro_ring_entry*)(void*)(io->data + (t & io->mask));
        if (e->kind != FERRO_PAD) return e;
        skip = io->cap - (t & io->mask);
        if ((uint32_t)(ferro_load(&io->ctrl->head) - t) < skip) return e;
        t += skip;
        ferro_ring_publish_tail(io, t);
    }
    return NULL;
}

/* consumer: whether the entry at tail, header and payload, lies within what its producer
 * published and within the data area (a payload length no producer wrote must not be copied
 * out of the ring) */
static inline int ferro_ring_published(ferro_ring_io* io, const ferro_ring_entry* e) {
    uint32_t t = ferro_load(&io->ctrl->tail);
    uint64_t size = 32u + (uint64_t)e->len;
    return size <= (uint32_t)(ferro_load(&io->ctrl->head) - t) && size <= io->cap - (t & io->mask);
}

/* consumer: the entry at tail is done with */
static inline void ferro_ring_consume(ferro_ring_io* io, const ferro_ring_entry* e) {
    ferro_ring_publish_tail(io, ferro_load(&io->ctrl->tail) + ferro_entry_bytes(e->len));
}

#endif
