"""A GPT-style model built from ferro's layers (the README shows the same one)."""

from __future__ import annotations

import numpy as np

from ferro_fsdp import Module, nn


class TinyGPT(Module):
    """Token + position embeddings, ``layers`` pre-LN blocks, a final LayerNorm, a linear head;
    ``forward(idx [batch, seq]) -> logits [batch, seq, vocab]``."""

    def __init__(self, vocab, seq, embed_dim, num_heads, layers, *, dtype=np.float32, rng=0):
        super().__init__()
        rng = np.random.default_rng(rng)
        self.wte = nn.Embedding(vocab, embed_dim, dtype=dtype, rng=rng)
        self.wpe = nn.Embedding(seq, embed_dim, dtype=dtype, rng=rng)
        self.h = nn.Sequential(*[nn.TransformerBlock(embed_dim, num_heads, dtype=dtype, rng=rng)
                                 for _ in range(layers)])
        self.ln_f = nn.LayerNorm(embed_dim, dtype=dtype)
        self.head = nn.Linear(embed_dim, vocab, bias=False, dtype=dtype, rng=rng)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(np.arange(idx.shape[-1]))
        return self.head(self.ln_f(self.h(x)))

    def backward(self, grad_logits):
        g = self.h.backward(self.ln_f.backward(self.head.backward(grad_logits)))
        self.wte.backward(g)
        self.wpe.backward(g.reshape(-1, *g.shape[-2:]).sum(axis=0))


def lm_step(model, loss_fn, idx, targets):
    """Forward, cross entropy over ``[batch * seq, vocab]``, backward; returns the loss."""
    logits = model(idx)
    vocab = logits.shape[-1]
    loss = loss_fn(logits.reshape(-1, vocab), targets.reshape(-1))
    model.backward(loss_fn.backward().reshape(logits.shape))
    return loss
