/* A client of the engine's door, compiled at test time against the installed headers (as C and
 * as C++) and driven from Python with ctypes: what an outside C program, a C++ backend or a
 * JAX handler does, through ferro/engine.h alone. */
#include <stddef.h>
#include <stdint.h>

#include "ferro/engine.h"

#ifdef __cplusplus
#define SHIM extern "C"
#else
#define SHIM
#endif

enum { BARRIER, ALLREDUCE, REDUCE, REDUCE_SCATTER, ALL_GATHER, GATHER, SCATTER, BROADCAST,
       ALL_TO_ALL };

/* the communicator a capsule's pointer names, with a reference of our own; NULL and why */
SHIM void* shim_attach(void* handle, char* why, size_t why_len) {
    return ferro_attach(handle, why, why_len);
}

SHIM void shim_release(void* c) { ferro_api((ferro_comm*)c)->release((ferro_comm*)c); }

SHIM int shim_rank(void* c) { return ferro_api((ferro_comm*)c)->rank((ferro_comm*)c); }

SHIM int shim_size(void* c) { return ferro_api((ferro_comm*)c)->world_size((ferro_comm*)c); }

SHIM long long shim_reserve(void* c) {
    return (long long)ferro_api((ferro_comm*)c)->reserve((ferro_comm*)c);
}

SHIM int shim_skip(void* c, long long ticket) {
    return ferro_api((ferro_comm*)c)->skip((ferro_comm*)c, (int64_t)ticket);
}

SHIM int shim_close(void* c) { return ferro_api((ferro_comm*)c)->close((ferro_comm*)c); }

SHIM const char* shim_error(void* c) { return ferro_api((ferro_comm*)c)->last_error(); }

SHIM const char* shim_status(void* c, int status) {
    return ferro_api((ferro_comm*)c)->status_name(status);
}

/* one collective: counts as ferro/engine.h gives them; timeout 0: the default; ticket -1: now;
 * flags: the opts' (FERRO_OPTS_SPAN) */
SHIM int shim_call_flags(void* cv, int kind, const void* send, void* recv, size_t count,
                         int dtype, int op, int root, double timeout, long long ticket,
                         unsigned flags) {
    ferro_comm* c = (ferro_comm*)cv;
    const ferro_engine_api* f = ferro_api(c);
    ferro_opts o = FERRO_OPTS_INIT;
    o.timeout = timeout;
    o.ticket = (int64_t)ticket;
    o.flags = flags;
    switch (kind) {
    case BARRIER: return f->barrier(c, &o);
    case ALLREDUCE: return f->allreduce(c, send, recv, count, dtype, op, &o);
    case REDUCE: return f->reduce(c, send, recv, count, dtype, op, root, &o);
    case REDUCE_SCATTER: return f->reduce_scatter(c, send, recv, count, dtype, op, &o);
    case ALL_GATHER: return f->all_gather(c, send, recv, count, dtype, &o);
    case GATHER: return f->gather(c, send, recv, count, dtype, root, &o);
    case SCATTER: return f->scatter(c, send, recv, count, dtype, root, &o);
    case BROADCAST: return f->broadcast(c, send, recv, count, dtype, root, &o);
    case ALL_TO_ALL: return f->all_to_all(c, send, recv, count, dtype, &o);
    default: return -1;
    }
}

SHIM int shim_call(void* cv, int kind, const void* send, void* recv, size_t count, int dtype,
                   int op, int root, double timeout, long long ticket) {
    return shim_call_flags(cv, kind, send, recv, count, dtype, op, root, timeout, ticket, 0u);
}

SHIM int shim_send(void* cv, const void* buf, size_t nbytes, int dst, unsigned long long tag,
                   double timeout) {
    ferro_comm* c = (ferro_comm*)cv;
    ferro_opts o = FERRO_OPTS_INIT;
    o.timeout = timeout;
    return ferro_api(c)->send(c, buf, nbytes, dst, (uint64_t)tag, &o);
}

/* src -1: FERRO_ANY_SOURCE; the sender into *source */
SHIM int shim_recv(void* cv, void* buf, size_t nbytes, int src, unsigned long long tag,
                   double timeout, int* source) {
    ferro_comm* c = (ferro_comm*)cv;
    ferro_opts o = FERRO_OPTS_INIT;
    o.timeout = timeout;
    return ferro_api(c)->recv(c, buf, nbytes, src == -1 ? FERRO_ANY_SOURCE : src, (uint64_t)tag,
                              source, &o);
}
