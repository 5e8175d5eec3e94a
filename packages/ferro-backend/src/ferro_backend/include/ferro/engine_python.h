/* ferro/engine_python.h: a communicator from the capsule Python hands over (ferro/engine.h).
 *
 * The one place a client needs Python: at attach time, with the GIL held. The calls that
 * follow need neither Python nor the GIL.
 *
 *     PyObject* cap = ...ferro_backend.engine.comm_capsule(backend)...;
 *     char why[256];
 *     ferro_comm* c = ferro_attach_capsule(cap, why, sizeof why);
 *     if (c == NULL) { PyErr_SetString(PyExc_RuntimeError, why); ... }
 */
#ifndef FERRO_ENGINE_PYTHON_H
#define FERRO_ENGINE_PYTHON_H

#include <Python.h>

#include "ferro/engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ferro_attach on the capsule's pointer (NULL, with why, for anything but a capsule named
 * FERRO_ENGINE_CAPSULE, or an engine of another ABI); a Python error is never left set. */
static inline ferro_comm* ferro_attach_capsule(PyObject* capsule, char* why, size_t why_len) {
    void* handle;
    if (capsule == NULL || !PyCapsule_IsValid(capsule, FERRO_ENGINE_CAPSULE)) {
        ferro_attach_why(why, why_len, "ferro_attach_capsule: expected a capsule named "
                         FERRO_ENGINE_CAPSULE " (ferro_backend.engine.comm_capsule)", 0u, 0u);
        return NULL;
    }
    handle = PyCapsule_GetPointer(capsule, FERRO_ENGINE_CAPSULE);
    if (handle == NULL) {
        PyErr_Clear();
        ferro_attach_why(why, why_len, "ferro_attach_capsule: the capsule holds no "
                         "communicator", 0u, 0u);
        return NULL;
    }
    return ferro_attach(handle, why, why_len);
}

#ifdef __cplusplus
}
#endif

#endif
