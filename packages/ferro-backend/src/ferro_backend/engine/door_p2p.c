/* The door's point-to-point calls: send and recv on rings of their own (_layout.h's door rings,
 * moved with _ringio.h), apart from ferro's Python messages.
 *
 * A message is one EAGER entry (up to a quarter of a ring) or CHUNK entries (offset in aux,
 * size in total) written back to back: the sender holds its ring's send lock for the whole
 * message. A receive takes its source's receive lock only while it looks: a message for
 * another tag found on the way is moved aside (copied out, in arrival order), so that the ring
 * moves on and a receive for that tag finds it later; then it waits for the ring's head without
 * the lock. Matching: the first message from src (or from any rank) on tag, FIFO per (source,
 * tag). No tickets: point-to-point calls may run at once with collectives and with each other.
 * No Python.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "_door.h"
#include "_ringio.h"

/* a message moved aside */
typedef struct ferro_aside {
    struct ferro_aside* next;
    uint64_t tag;
    size_t nbytes;
    unsigned char data[];
} ferro_aside;

struct ferro_p2p {
    pthread_mutex_t* send_locks;   /* per destination */
    pthread_mutex_t* recv_locks;   /* per source */
    ferro_aside** first;           /* per source: the messages moved aside, oldest first */
    ferro_aside** last;
    int next_any;                  /* where a receive from any rank looks first */
};

int ferro_p2p_init(ferro_comm* c) {
    int n = c->s.n, r;
    ferro_p2p* p = (ferro_p2p*)calloc(1, sizeof *p);
    if (p == NULL) return -1;
    p->send_locks = (pthread_mutex_t*)calloc((size_t)n, sizeof(pthread_mutex_t));
    p->recv_locks = (pthread_mutex_t*)calloc((size_t)n, sizeof(pthread_mutex_t));
    p->first = (ferro_aside**)calloc((size_t)n, sizeof(ferro_aside*));
    p->last = (ferro_aside**)calloc((size_t)n, sizeof(ferro_aside*));
    if (!p->send_locks || !p->recv_locks || !p->first || !p->last) {
        free(p->send_locks);
        free(p->recv_locks);
        free(p->first);
        free(p->last);
        free(p);
        return -1;
    }
    for (r = 0; r < n; r++) {
        pthread_mutex_init(&p->send_locks[r], NULL);
        pthread_mutex_init(&p->recv_locks[r], NULL);
    }
    c->p2p = p;
    return 0;
}

void ferro_p2p_free(ferro_comm* c) {
    ferro_p2p* p = c->p2p;
    ferro_aside *a, *next;
    int r;
    if (p == NULL) return;
    for (r = 0; r < c->s.n; r++) {
        for (a = p->first[r]; a != NULL; a = next) {
            next = a->next;
            free(a);
        }
        pthread_mutex_destroy(&p->send_locks[r]);
        pthread_mutex_destroy(&p->recv_locks[r]);
    }
    free(p->send_locks);
    free(p->recv_locks);
    free(p->first);
    free(p->last);
    free(p);
    c->p2p = NULL;
}

static void ring_io(ferro_comm* c, int src, int dst, ferro_ring_io* io) {
    ferro_ring_io_init(io, ferro_door_ring_of(c->base, &c->s.L, src, dst),
                       (uint32_t)c->s.L.ring_bytes, NULL, &c->failed, c->s.pol.spin,
                       c->s.pol.yields);
}

/* the status and message of a point-to-point wait that did not end well */
static int p2p_failed(ferro_comm* c, int rc, const char* what, int peer, uint64_t tag,
                      double timeout) {
    if (rc == FERRO_TIMEOUT)
        return ferro_door_say(FERRO_TIMEOUT, "%s rank %d (tag %llu) on rank %d: timed out after "
                              "%gs", what, peer, (unsigned long long)tag, c->s.me, timeout);
    if (ferro_load(&c->closed))
        return ferro_door_say(FERRO_CLOSED, "%s rank %d on rank %d: the engine was closed", what,
                              peer, c->s.me);
    pthread_mutex_lock(&c->lock);
    rc = ferro_door_say(FERRO_FAILED, "%s rank %d (tag %llu) on rank %d: %.900s", what, peer,
                        (unsigned long long)tag, c->s.me,
                        c->failure[0] ? c->failure : "the engine was shut down");
    pthread_mutex_unlock(&c->lock);
    return rc;
}

int ferro_door_send(ferro_comm* c, const void* buf, size_t nbytes, int dst, uint64_t tag,
                    const ferro_opts* o) {
    ferro_ring_io io;
    double timeout = c->timeout, deadline;
    uint32_t maxp, start, n;
    size_t off = 0;
    int rc = ferro_door_check_opts(o, "send", &timeout), hooked = 0;
    if (rc != FERRO_OK) return rc;
    if (dst < 0 || dst >= c->s.n)
        return ferro_door_say(FERRO_INVALID, "send: rank %d is not a rank of %d", dst, c->s.n);
    if (buf == NULL && nbytes > 0)
        return ferro_door_say(FERRO_INVALID, "send: buf is NULL for %zu bytes", nbytes);
    if (ferro_load(&c->closed))
        return ferro_door_say(FERRO_CLOSED, "send to rank %d on rank %d: the engine is closed",
                              dst, c->s.me);
    deadline = ferro_now_late() + timeout;
    ring_io(c, c->s.me, dst, &io);
    maxp = ferro_ring_max_payload(&io);
    if (o != NULL && o->wait_hook != NULL
            && (nbytes > maxp || io.cap - (ferro_load(&io.ctrl->head) - ferro_load(&io.ctrl->tail))
                < ferro_entry_bytes((uint32_t)nbytes) + 64u)) {
        hooked = 1;  /* it may wait for room: let the caller's lock go first */
        o->wait_hook(o->wait_ctx, 1);
    }
    pthread_mutex_lock(&c->p2p->send_locks[dst]);
    if (nbytes <= maxp) {
        rc = ferro_ring_put(&io, FERRO_EAGER, tag, nbytes, 0, (const unsigned char*)buf,
                            (uint32_t)nbytes, deadline, 1, &start);
    } else {
        while (off < nbytes && rc == FERRO_OK) {
            n = (uint32_t)(nbytes - off < maxp ? nbytes - off : maxp);
            rc = ferro_ring_put(&io, FERRO_CHUNK, tag, nbytes, off,
                                (const unsigned char*)buf + off, n, deadline, 1, &start);
            off += n;
        }
    }
    pthread_mutex_unlock(&c->p2p->send_locks[dst]);
    if (hooked) o->wait_hook(o->wait_ctx, 0);
    return rc == FERRO_OK ? FERRO_OK : p2p_failed(c, rc, "send to", dst, tag, timeout);
}

/* Copy the message whose first entry is at the ring's tail (EAGER, or CHUNK at offset 0) into
 * out (nbytes: the message's size), its chunks as they come; FERRO_OK, a wait's status, or -1
 * for a ring that does not hold what a producer writes. */
static int take_message(ferro_ring_io* io, unsigned char* out, size_t nbytes, uint64_t tag,
                        double deadline) {
    ferro_ring_entry* e;
    size_t off = 0;
    int rc;
    while (off < nbytes || off == 0) {
        e = ferro_ring_head(io);
        if (e == NULL) {
            rc = ferro_ring_wait(io, 0, ferro_load(&io->ctrl->tail), deadline, 1, 0.0);
            if (rc != FERRO_OK) return rc;
            continue;
        }
        if (!ferro_ring_published(io, e) || e->tag != tag || e->total != nbytes
                || (e->kind == FERRO_EAGER ? off != 0 || e->len != nbytes
                    : e->kind != FERRO_CHUNK || e->aux != off || off + e->len > nbytes
                      || e->len == 0))
            return -1;
        if (e->len) memcpy(out + off, (const unsigned char*)e + 32, e->len);
        off += e->len;
        ferro_ring_consume(io, e);
        if (nbytes == 0) break;
    }
    return FERRO_OK;
}

/* Under src's receive lock: the first message on tag (moved aside before, or next in the
 * ring, moving others aside on the way) into buf. *found: 1 delivered, 0 not there yet (then
 * *head: the ring's head looked at, to wait on). */
static int look(ferro_comm* c, int src, void* buf, size_t nbytes, uint64_t tag, double deadline,
                double timeout, int* found, uint32_t* head) {
    ferro_p2p* p = c->p2p;
    ferro_aside **at = &p->first[src], *a, *prev = NULL;
    ferro_ring_io io;
    ferro_ring_entry* e;
    int rc;
    *found = 0;
    for (a = *at; a != NULL; prev = a, a = a->next) {
        if (a->tag != tag) continue;
        if (prev == NULL) p->first[src] = a->next;
        else prev->next = a->next;
        if (p->last[src] == a) p->last[src] = prev;
        *found = 1;
        rc = a->nbytes == nbytes ? FERRO_OK
            : ferro_door_say(FERRO_INVALID, "recv from rank %d (tag %llu): a message of %zu bytes "
                             "for a %zu-byte buffer", src, (unsigned long long)tag, a->nbytes,
                             nbytes);
        if (rc == FERRO_OK && nbytes) memcpy(buf, a->data, nbytes);
        free(a);
        return rc;
    }
    ring_io(c, src, c->s.me, &io);
    for (;;) {
        *head = ferro_load(&io.ctrl->head);
        e = ferro_ring_head(&io);
        if (e == NULL) return FERRO_OK;
        if (e->kind != FERRO_EAGER && (e->kind != FERRO_CHUNK || e->aux != 0))
            return ferro_door_say(FERRO_FAILED, "recv from rank %d: its ring holds an entry no "
                                  "sender writes (kind %u)", src, e->kind);
        if (e->tag == tag && e->total == nbytes) {
            *found = 1;
            rc = take_message(&io, (unsigned char*)buf, nbytes, tag, deadline);
            if (rc == -1)
                return ferro_door_say(FERRO_FAILED, "recv from rank %d: a corrupt message", src);
            return rc == FERRO_OK ? rc : p2p_failed(c, rc, "recv from", src, tag, timeout);
        }
        a = (ferro_aside*)malloc(sizeof *a + (size_t)e->total);
        if (a == NULL) return ferro_door_say(FERRO_NOMEM, "recv: no memory to set a message of "
                                             "%llu bytes aside", (unsigned long long)e->total);
        a->next = NULL;
        a->tag = e->tag;
        a->nbytes = (size_t)e->total;
        rc = take_message(&io, a->data, a->nbytes, a->tag, deadline);
        if (rc != FERRO_OK) {
            free(a);
            if (rc == -1)
                return ferro_door_say(FERRO_FAILED, "recv from rank %d: a corrupt message", src);
            return p2p_failed(c, rc, "recv from", src, tag, timeout);
        }
        if (a->tag == tag) {  /* this tag, another size: the caller's error */
            *found = 1;
            rc = ferro_door_say(FERRO_INVALID, "recv from rank %d (tag %llu): a message of %zu "
                                "bytes for a %zu-byte buffer", src, (unsigned long long)tag,
                                a->nbytes, nbytes);
            free(a);
            return rc;
        }
        if (p->last[src] != NULL) p->last[src]->next = a;
        else p->first[src] = a;
        p->last[src] = a;
    }
}

int ferro_door_recv(ferro_comm* c, void* buf, size_t nbytes, int src, uint64_t tag,
                    int* source, const ferro_opts* o) {
    ferro_ring_io io;
    double timeout = c->timeout, deadline;
    struct timespec nap = {0, 20000};
    uint32_t head = 0;
    int rc = ferro_door_check_opts(o, "recv", &timeout), found = 0, r, k, hooked = 0, spins = 0;
    int n = c->s.n;
    if (rc != FERRO_OK) return rc;
    if (src < FERRO_ANY_SOURCE || src >= n)
        return ferro_door_say(FERRO_INVALID, "recv: rank %d is not a rank of %d (nor "
                              "FERRO_ANY_SOURCE)", src, n);
    if (buf == NULL && nbytes > 0)
        return ferro_door_say(FERRO_INVALID, "recv: buf is NULL for %zu bytes", nbytes);
    if (ferro_load(&c->closed))
        return ferro_door_say(FERRO_CLOSED, "recv on rank %d: the engine is closed", c->s.me);
    deadline = ferro_now_late() + timeout;
    for (;;) {
        for (k = 0; k < (src == FERRO_ANY_SOURCE ? n : 1) && !found; k++) {
            r = src != FERRO_ANY_SOURCE ? src : (c->p2p->next_any + k) % n;
            pthread_mutex_lock(&c->p2p->recv_locks[r]);
            rc = look(c, r, buf, nbytes, tag, deadline, timeout, &found, &head);
            pthread_mutex_unlock(&c->p2p->recv_locks[r]);
            if (found || rc != FERRO_OK) {
                if (source != NULL) *source = r;
                c->p2p->next_any = (r + 1) % n;
                break;
            }
        }
        if (found || rc != FERRO_OK) break;  /* (look said what went wrong) */
        if (o != NULL && o->wait_hook != NULL && !hooked) {
            hooked = 1;
            o->wait_hook(o->wait_ctx, 1);
        }
        if (src != FERRO_ANY_SOURCE) {  /* sleep on the ring's head */
            ring_io(c, src, c->s.me, &io);
            rc = ferro_ring_wait(&io, 0, head, deadline, 1, 0.0);
        } else if (ferro_load(&c->failed)) {
            rc = FERRO_FAILED;
        } else if (ferro_now() >= deadline) {
            rc = FERRO_TIMEOUT;
        } else if (++spins > 64) {  /* any rank: look again after a nap */
            nanosleep(&nap, NULL);
        }
        if (rc != FERRO_OK) {  /* the wait's status: say it */
            rc = p2p_failed(c, rc, "recv from", src, tag, timeout);
            break;
        }
    }
    if (hooked) o->wait_hook(o->wait_ctx, 0);
    return rc;
}
