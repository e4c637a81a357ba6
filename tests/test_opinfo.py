"""PyTorch's OpInfo database through ``eqfuse.compile`` (benchmarks/opinfo_sweep.py says
what counts as wrong): every op's first sample in float32, and a seeded quarter of the
ops in float16, each no wrong result and no error other than eqfuse's own clear refusal
(a function it cannot trace), on its own inputs and then, through the same compiled
function, on them shuffled, with a NaN and non-contiguous (``opinfo_sweep.VARIANTS``).
The whole sweep, with the coverage, is the benchmark's."""

import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import opinfo_sweep  # noqa: E402

OPS = opinfo_sweep.op_db()
HALF_SHARE = sorted(random.Random(0).sample(range(len(OPS)), len(OPS) // 4))
CASES = [(i, torch.float32) for i in range(len(OPS))] + [(i, torch.float16) for i in HALF_SHARE]


@pytest.mark.parametrize("index,dtype", CASES,
                         ids=[f"{OPS[i].name}.{OPS[i].variant_test_name}-{str(d)[6:]}" for i, d in CASES])
def test_opinfo_sample_is_right_or_refused(index, dtype):
    op = OPS[index]
    rows = opinfo_sweep.sweep([op], [dtype], 1, log=lambda line: None)
    bad = [r for r in rows if r["outcome"] in ("wrong", "error")]
    assert not bad, bad
