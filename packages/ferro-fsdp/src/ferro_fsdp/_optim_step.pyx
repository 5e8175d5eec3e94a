# cython: language_level=3
"""One pass over a flat parameter for SGD, Adam and AdamW: the optimizers' numpy steps fused.

Each function reproduces, element by element, the sequence of operations the numpy step in
``optim.py`` performs (each operation rounded to the parameter's dtype, the hyper-parameters
rounded to it first, as numpy does with Python floats), so the results are the same bits; it
reads and writes every array once instead of once per numpy operation, and runs without the
GIL. The build passes ``-ffp-contract=off`` (no fused multiply-add: each product is rounded
as numpy rounds it) and ``-fno-math-errno`` (so ``sqrt`` vectorizes). Validation lives in
``optim.py`` only: the arrays are 1-d, C-contiguous, of one dtype and one length, and
``param``/state are writable.
"""

cimport cython
from cython cimport floating
from libc.math cimport sqrt, sqrtf


cdef inline void _sgd_plain(floating* p, const floating* g, Py_ssize_t n, floating lr,
                            floating wd, bint has_wd) noexcept nogil:
    cdef Py_ssize_t i
    cdef floating d, gi, pi
    for i in range(n):
        pi = p[i]
        gi = g[i]
        d = gi + wd * pi
        d = d if has_wd else gi
        p[i] = pi - d * lr


cdef inline void _sgd_momentum(floating* p, const floating* g, floating* buf, Py_ssize_t n,
                               floating lr, floating wd, floating momentum, floating damp,
                               bint nesterov, bint has_wd) noexcept nogil:
    """The flags pick between values that are both computed (selects, not branches), so the C
    compiler vectorizes the loop. ``damp`` is ``1 - dampening``: exactly 1 without dampening,
    and ``1 * d`` is ``d`` bit for bit. The first step (the buffer becomes ``d``) is numpy's."""
    cdef Py_ssize_t i
    cdef floating d, b, pi, gi, nest
    for i in range(n):
        pi = p[i]
        gi = g[i]
        d = gi + wd * pi
        d = d if has_wd else gi
        b = buf[i] * momentum + damp * d
        buf[i] = b
        nest = d + momentum * b
        nest = nest if nesterov else b
        p[i] = pi - nest * lr


@cython.cdivision(True)
cdef inline void _adam(floating* p, const floating* g, floating* m, floating* v, Py_ssize_t n,
                       floating beta1, floating one_minus_beta1, floating beta2,
                       floating one_minus_beta2, floating bias2_sqrt, floating eps,
                       floating step_size, floating wd, floating decay, bint l2) noexcept nogil:
    """``l2``: Adam's decay added to the gradient. ``decay``: AdamW's ``1 - lr * wd``, which
    is exactly 1 for Adam (``p * 1`` is ``p`` bit for bit)."""
    cdef Py_ssize_t i
    cdef floating d, gi, pi, mi, vi, denom
    for i in range(n):
        pi = p[i] * decay
        gi = g[i]
        d = gi + wd * pi
        d = d if l2 else gi
        mi = m[i] * beta1 + one_minus_beta1 * d
        m[i] = mi
        vi = v[i] * beta2 + one_minus_beta2 * (d * d)
        v[i] = vi
        if floating is float:
            denom = sqrtf(vi) / bias2_sqrt + eps
        else:
            denom = sqrt(vi) / bias2_sqrt + eps
        p[i] = pi - step_size * (mi / denom)


def sgd_step(floating[::1] param, const floating[::1] grad, floating[::1] momentum_buffer,
             double lr, double weight_decay, double momentum, double dampening, bint nesterov):
    """torch's SGD on one flat parameter, after its first step when ``momentum != 0`` (the
    buffer exists; it is not read when ``momentum == 0``)."""
    cdef Py_ssize_t n = param.shape[0]
    if n == 0:
        return
    with nogil:
        if momentum == 0:
            _sgd_plain(&param[0], &grad[0], n, <floating>lr, <floating>weight_decay,
                       weight_decay != 0)
        elif nesterov:   # a constant flag: the inlined loop has one select left, and vectorizes
            _sgd_momentum(&param[0], &grad[0], &momentum_buffer[0], n, <floating>lr,
                          <floating>weight_decay, <floating>momentum, <floating>(1.0 - dampening),
                          True, weight_decay != 0)
        else:
            _sgd_momentum(&param[0], &grad[0], &momentum_buffer[0], n, <floating>lr,
                          <floating>weight_decay, <floating>momentum, <floating>(1.0 - dampening),
                          False, weight_decay != 0)


def adam_step(floating[::1] param, const floating[::1] grad, floating[::1] exp_avg,
              floating[::1] exp_avg_sq, double beta1, double beta2, double bias2_sqrt,
              double eps, double step_size, double weight_decay, double lr, bint decoupled):
    """Adam (L2 decay added to the gradient) or AdamW (``decoupled``: ``param *= 1 - lr *
    weight_decay`` first) on one flat parameter; ``step_size = lr / (1 - beta1 ** step)``."""
    cdef Py_ssize_t n = param.shape[0]
    cdef double decay = 1.0 - lr * weight_decay if decoupled else 1.0
    if n == 0:
        return
    with nogil:
        _adam(&param[0], &grad[0], &exp_avg[0], &exp_avg_sq[0], n, <floating>beta1,
              <floating>(1.0 - beta1), <floating>beta2, <floating>(1.0 - beta2),
              <floating>bias2_sqrt, <floating>eps, <floating>step_size,
              <floating>weight_decay, <floating>decay, weight_decay != 0 and not decoupled)
