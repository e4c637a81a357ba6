"""Code generation details: int64 offsets, masks, constexprs, readability."""

import torch

import eqfuse
from eqfuse.codegen.kernel import generate
from eqfuse.schema.plan import Buffer, KernelSpec, PNode


def _add_spec(numel):
    shape = (numel,)
    a = PNode("load", ("in0", (1,), 0), (), shape, "float16")
    b = PNode("load", ("in1", (1,), 0), (), shape, "float16")
    add = PNode("binary", ("add",), (a, b), shape, "float16")
    buffers = {n: Buffer(n, shape, "float16", "input") for n in ("in0", "in1", "out")}
    return KernelSpec("k0_add", [(add, "out")], ["add"]), buffers


def test_int64_offsets_when_a_tensor_has_2_31_elements():
    spec, buffers = _add_spec(2**31)
    text, *_ = generate(spec, buffers)
    assert "tl.program_id(0).to(tl.int64)" in text


def test_int32_offsets_below_2_31():
    spec, buffers = _add_spec(2**31 - 1)
    text, *_ = generate(spec, buffers)
    assert "tl.int64" not in text


def test_no_mask_when_blocks_divide_the_sizes():
    x = torch.randn(8, 64)
    c = eqfuse.compile(lambda x: torch.softmax(x, -1), (x,))
    src = c.kernels[0].source
    assert "mask" not in src and c.kernels[0].constexprs["BLOCK_C"] == 64


def test_kernel_attributes_are_readable():
    x, w = torch.randn(6, 10), torch.rand(10)
    from eqfuse.examples import rmsnorm
    c = eqfuse.compile(rmsnorm, (x, w), autotune=False)
    (k,) = c.kernels
    assert k.name.startswith("k0_")
    assert set(k.fx_nodes) >= {"pow_1", "mean", "rsqrt"}
    assert k.constexprs == {"R": 6, "C": 10, "BLOCK_R": 8, "BLOCK_C": 16}
    assert k.grid == (1,)
    assert k.source in c.source and '"""FX nodes: ' in k.source
    compile(c.source, "generated", "exec")  # the module is valid Python


def test_a_config_that_does_not_fit_is_not_used():
    """A persistent row kernel with a block narrower than the row would drop columns."""
    x = torch.randn(3, 1000)
    c = eqfuse.compile(lambda x: torch.softmax(x, -1), (x,), autotune=False)
    (k,) = c.kernels
    text, sched, cfg, _ = generate(k.spec, c.plan.buffers, {"BLOCK_R": 1, "BLOCK_C": 16, "num_warps": 1})
    assert cfg["BLOCK_C"] >= 1000
