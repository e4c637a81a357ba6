"""Train a small transformer for a few steps with torch.compile(backend="eqfuse") and
show that its losses follow eager's.

    python examples/train_small.py
"""

import copy

import torch
import torch.nn as nn

import eqfuse.backend
from eqfuse.models import LlamaLayer


class TinyLM(nn.Module):
    def __init__(self, vocab=128, hidden=64, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(LlamaLayer(hidden, heads=4, intermediate=128) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def train(model, batches, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for tokens in batches[:steps]:
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(steps=5):
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = TinyLM().to(device)
    batches = [torch.randint(0, 128, (4, 17), device=device) for _ in range(steps)]
    eager = train(copy.deepcopy(model), batches, steps)
    compiled = train(torch.compile(model, backend="eqfuse"), batches, steps)
    for i, (e, c) in enumerate(zip(eager, compiled)):
        print(f"step {i}: eager loss {e:.6f}   eqfuse loss {c:.6f}")
    kernels = sum(len(g.kernels) for g in eqfuse.backend.history)
    print(f"{len(eqfuse.backend.history)} graphs compiled by eqfuse, {kernels} Triton kernels")
    assert max(abs(e - c) for e, c in zip(eager, compiled)) < 1e-3, "losses diverged"


if __name__ == "__main__":
    main()
