/* The door's communicator, as the engine's own code sees it (ferro/engine.h is what clients
 * see): the mapping of the segment, the steps' state, the order of calls and the errors.
 *
 * door.c implements it and the public table; _comm.pyx is its Python face (Engine.slots),
 * which also runs the steps of the collectives only ferro's Python has (uneven sizes, objects)
 * inside a turn of the same order (ferro_comm_begin / ferro_comm_end).
 */
#ifndef FERRO_DOOR_H
#define FERRO_DOOR_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "ferro/engine.h"
#include "_probe.h"
#include "_split.h"
#include "_steps.h"
#include "_stream.h"

/* the longest message a call leaves */
#define FERRO_MSG 1024

typedef struct ferro_p2p ferro_p2p;

struct ferro_comm {
    ferro_comm_head head;        /* magic, ABI, table: what clients read (ferro/engine.h) */
    uint32_t refs;               /* references; the last release unmaps and frees */
    unsigned char* base;         /* the mapped segment */
    size_t size;
    uint32_t failed;             /* raised when a peer dies, closes or aborts: every wait ends */
    uint32_t closed;
    double timeout;              /* the default timeout of a call */
    double stall_fraction;       /* a call reports a stall after this part of its timeout */
    /* the order of calls (the thread rule) */
    pthread_mutex_t lock;        /* guards what follows up to the errors */
    int64_t next_ticket;         /* what reserve() hands out next */
    int64_t serving;             /* the ticket whose turn it is */
    int64_t* skipped;            /* tickets ahead of serving given back early, in order */
    size_t nskipped, skip_room;
    uint32_t turn;               /* grows with serving: the futex word turn waits sleep on */
    uint32_t turn_sleepers;
    uintptr_t now_thread;        /* the thread in an unreserved call (0: none) */
    const char* now_name;        /*   and that call's collective */
    uintptr_t running_thread;    /* the thread whose call holds the turn (0: none) */
    /* errors: the first failure's reason, and what broke the communicator */
    char failure[FERRO_MSG];
    int broken;                  /* FERRO_TIMEOUT or FERRO_FAILED once broken (0: not) */
    char broken_msg[FERRO_MSG];
    /* the stall report, and the call under way (for its messages) */
    ferro_stall_fn stall;
    void* stall_ctx;
    const char* call_name;
    int64_t call_seq;
    double call_start, call_timeout;
    unsigned char last_header[FERRO_HEADER_BYTES];  /* the last door call's header (seq 0) */
    uint64_t last_hash;          /*   and its hash */
    ferro_slots s;               /* the steps (one call at a time: the turn's holder's) */
    /* the link's re-probes (rank 0 asks; door.c: ask_reprobe): at most every reprobe_s
     * seconds (0: never), sooner when the recent copies (s.put) move from probe_put_ns */
    double reprobe_s;
    double probe_put_ns;
    unsigned probe_looks;
    int64_t probed_before;       /* the ticket + 1 this rank last probed before (0: none) */
    ferro_p2p* p2p;              /* the point-to-point calls' state (door_p2p.c) */
};

/* A communicator over the segment in fd (size bytes, the layout of nranks ranks with these slot
 * and ring sizes), for rank; waits spin `spin` times, then yield `yields` times, before they
 * sleep; calls without a timeout of their own take `timeout`. One reference (the caller's).
 * NULL with the reason in why otherwise. */
ferro_comm* ferro_comm_create(int fd, size_t size, int nranks, int rank, size_t slot_bytes,
                              size_t ring_bytes, int spin, int yields, double timeout,
                              char* why, size_t why_len);
/* the table every communicator points to */
const ferro_engine_api* ferro_engine_table(void);
/* A peer died, closed or aborted (reason, kept if it is the first), or this rank closes: raise
 * the failure flag and wake every wait on the segment (steps, rings, the turn). */
void ferro_comm_mark_failed(ferro_comm* c, const char* reason);
/* a forked child's copy: closed in this process only (door.c) */
void ferro_comm_forked(ferro_comm* c);
/* Wait (until timeout seconds from now) for ticket's turn, for Python's own steps: FERRO_OK, or
 * a status with its message (last_error); the turn is then ferro_comm_end's to give back. */
int ferro_comm_begin(ferro_comm* c, int64_t ticket, double timeout, const char* name);
void ferro_comm_end(ferro_comm* c, int64_t ticket);
/* Ticket's call, whose turn this is, took count fewer tickets than a peer's call at the same
 * place (their headers' spans, after a mismatch): give the next count back unrun, unless a
 * call reserved one after it. 1: given back; 0: calls were reserved after it; -1: no memory. */
int ferro_comm_catch_up(ferro_comm* c, int64_t ticket, int64_t count);
/* Mark the communicator broken with status and message (a Python step's timeout or failure). */
void ferro_comm_break(ferro_comm* c, int status, const char* message);
/* ranks that have not published this rank's step yet, into out (at most n); their count */
int ferro_comm_missing(ferro_comm* c, int* out);

/* (between door.c and door_p2p.c) this thread's message for status, printf-style; a call's
 * options checked (its timeout into *timeout); the point-to-point state and calls */
int ferro_door_say(int status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
int ferro_door_check_opts(const ferro_opts* o, const char* name, double* timeout);
int ferro_p2p_init(ferro_comm* c);
void ferro_p2p_free(ferro_comm* c);
int ferro_door_send(ferro_comm* c, const void* buf, size_t nbytes, int dst, uint64_t tag,
                    const ferro_opts* o);
int ferro_door_recv(ferro_comm* c, void* buf, size_t nbytes, int src, uint64_t tag,
                    int* source, const ferro_opts* o);

#endif
