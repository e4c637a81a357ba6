"""Small transformer blocks written in plain PyTorch, for tests and examples: a
Llama-style decoder layer (RMSNorm, rotary embedding, causal attention, SwiGLU MLP) and
a GPT-2 style block. Random weights; no downloads."""

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
