/* The GIL's wait hook (ferro/engine.h's opts.wait_hook, and the slots' own, _slots.h) for a
 * call or step made with the GIL held: it lets the GIL go when the wait goes beyond a short
 * spin (or the call is about to move much) and takes it back before the call returns. A peer
 * that arrives within the spin costs no GIL round trip, and other Python threads run while
 * this one waits. (The thread's state is kept per thread between the two calls.)
 */
#ifndef FERRO_GIL_H
#define FERRO_GIL_H

#include <Python.h>

static _Thread_local PyThreadState* ferro_gil_saved;

static inline void ferro_gil_hook(void* ctx, int waiting) {
    (void)ctx;
    if (waiting) ferro_gil_saved = PyEval_SaveThread();
    else PyEval_RestoreThread(ferro_gil_saved);
}

#endif
