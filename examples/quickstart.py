"""Compile a plain PyTorch function with eqfuse and look at what it became.

    python examples/quickstart.py
"""

import torch
import torch.nn.functional as F

import eqfuse


def layernorm_gelu(x, residual, weight, bias):
    h = x + residual
    return F.gelu(F.layer_norm(h, (h.shape[-1],), weight, bias))


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, r = torch.randn(2, 64, 768, device=device), torch.randn(2, 64, 768, device=device)
    w, b = torch.rand(768, device=device), torch.randn(768, device=device)
    compiled = eqfuse.compile(layernorm_gelu, (x, r, w, b))
    out = compiled(x, r, w, b)
    torch.testing.assert_close(out, layernorm_gelu(x, r, w, b), rtol=1e-4, atol=1e-5)
    print(compiled.explain())
    print()
    print(compiled.kernels[0].source)


if __name__ == "__main__":
    main()
