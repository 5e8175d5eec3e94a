"""torch twins of ferro's transformer layers, written with torch's own modules and
``scaled_dot_product_attention``: the oracle, with the same parameter names as ferro's."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn as tnn
from torch.nn import functional as F

TORCH_DTYPE = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}


class TorchAttention(tnn.Module):
    def __init__(self, embed_dim, num_heads, bias=True, dtype=torch.float32):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = tnn.Linear(embed_dim, 3 * embed_dim, bias=bias, dtype=dtype)
        self.proj = tnn.Linear(embed_dim, embed_dim, bias=bias, dtype=dtype)

    def forward(self, x):
        *lead, t, e = x.shape
        q, k, v = self.qkv(x).split(e, dim=-1)
        q, k, v = (z.reshape(*lead, t, self.num_heads, e // self.num_heads).transpose(-2, -3)
                   for z in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.transpose(-2, -3).reshape(*lead, t, e))


class TorchBlock(tnn.Module):
    def __init__(self, embed_dim, num_heads, approximate="none", dtype=torch.float32):
        super().__init__()
        self.ln1 = tnn.LayerNorm(embed_dim, dtype=dtype)
        self.attn = TorchAttention(embed_dim, num_heads, dtype=dtype)
        self.ln2 = tnn.LayerNorm(embed_dim, dtype=dtype)
        self.mlp = tnn.Sequential(tnn.Linear(embed_dim, 4 * embed_dim, dtype=dtype),
                                  tnn.GELU(approximate),
                                  tnn.Linear(4 * embed_dim, embed_dim, dtype=dtype),
                                  tnn.Dropout(0.0))
        self.drop = tnn.Dropout(0.0)

    def forward(self, x):
        h = x + self.drop(self.attn(self.ln1(x)))
        return h + self.mlp(self.ln2(h))


class TorchGPT(tnn.Module):
    def __init__(self, vocab, seq, embed_dim, num_heads, layers, dtype=torch.float32):
        super().__init__()
        self.wte = tnn.Embedding(vocab, embed_dim, dtype=dtype)
        self.wpe = tnn.Embedding(seq, embed_dim, dtype=dtype)
        self.h = tnn.Sequential(*[TorchBlock(embed_dim, num_heads, dtype=dtype)
                                  for _ in range(layers)])
        self.ln_f = tnn.LayerNorm(embed_dim, dtype=dtype)
        self.head = tnn.Linear(embed_dim, vocab, bias=False, dtype=dtype)

    def forward(self, idx):
        t = idx.shape[-1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        return self.head(self.ln_f(self.h(x)))


def load_from(torch_module, ferro_module):
    """Copy ferro's state dict into the torch twin (strict: the names must line up)."""
    torch_module.load_state_dict({k: torch.from_numpy(v) for k, v in ferro_module.state_dict().items()})
    return torch_module
