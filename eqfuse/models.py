"""Small transformer blocks written in plain PyTorch, for tests and examples: a
Llama-style decoder layer (RMSNorm, rotary embedding, causal attention, SwiGLU MLP), a
GPT-2 style block and a BERT layer (post-LayerNorm, bidirectional attention with an
additive padding mask). Random weights; no downloads. Default sizes are small, for
tests; the constructors take the published sizes too."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotary(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class LlamaLayer(nn.Module):
    def __init__(self, hidden: int = 64, heads: int = 4, intermediate: int = 128, max_seq: int = 64):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)
        self.norm1, self.norm2 = RMSNorm(hidden), RMSNorm(hidden)
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        angles = torch.outer(torch.arange(max_seq).float(), inv)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def attention(self, x):
        b, s, _ = x.shape
        q, k, v = (t(x).view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in (self.q, self.k, self.v))
        cos, sin = self.cos[:s], self.sin[:s]
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        mask = torch.tril(torch.ones(s, s, dtype=torch.bool, device=x.device))
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")).float(), dim=-1).to(q.dtype)
        return self.o((probs @ v).transpose(1, 2).reshape(b, s, -1))

    def forward(self, x):
        h = x + self.attention(self.norm1(x))
        y = self.norm2(h)
        return h + self.down(F.silu(self.gate(y)) * self.up(y))


class GPT2Block(nn.Module):
    def __init__(self, hidden: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


def padding_mask(lengths: torch.Tensor, seq: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The additive attention mask of HF's ``get_extended_attention_mask``: [batch, 1, 1, seq],
    0 on the first ``lengths[b]`` keys of row ``b`` and the dtype's lowest finite value on
    the padding after them."""
    keep = torch.arange(seq, device=lengths.device)[None, :] < lengths[:, None]
    return ((1.0 - keep.to(dtype)) * torch.finfo(dtype).min)[:, None, None, :]


class BertLayer(nn.Module):
    """One BERT encoder layer as in BERT-base (``BertLayer(768, 12, 3072)``): bidirectional
    self-attention, an additive padding mask, residual + LayerNorm after each sublayer
    (post-LN), a GELU (erf) MLP. ``forward(x, mask=None)``; ``mask`` is [batch, 1, 1, seq]
    (see ``padding_mask``)."""

    def __init__(self, hidden: int = 64, heads: int = 4, intermediate: int = 128, eps: float = 1e-12):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.attn_out = nn.Linear(hidden, hidden)
        self.ln1 = nn.LayerNorm(hidden, eps=eps)
        self.fc, self.out = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)
        self.ln2 = nn.LayerNorm(hidden, eps=eps)

    def attention(self, x, mask):
        b, s, d = x.shape
        q, k, v = (t(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
                   for t in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) * self.head_dim ** -0.5
        if mask is not None:
            scores = scores + mask
        ctx = torch.softmax(scores, dim=-1) @ v
        return self.attn_out(ctx.transpose(1, 2).reshape(b, s, d))

    def forward(self, x, mask=None):
        h = self.ln1(x + self.attention(x, mask))
        return self.ln2(h + self.out(F.gelu(self.fc(h))))
