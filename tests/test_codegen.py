"""Code generation details: int64 offsets, masks, constexprs, readability."""

import re

import pytest
import torch
from conftest import assert_matches

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


def _rotary_into_transposed_copy(k, cos, sin):
    """The Llama layer's K after rotary, written as [batch, heads, dim, seq] for q @ k^T,
    beside the same values in [batch, heads, seq, dim]: one read across the output's order."""
    k = k.transpose(1, 2)  # [B, H, S, D] view of [B, S, H, D]
    half = k.shape[-1] // 2
    rotated = k * cos + torch.cat([-k[..., half:], k[..., :half]], dim=-1) * sin
    return rotated.transpose(-1, -2).contiguous(), rotated.contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("seq", [64, 50, 17])
def test_a_read_across_the_output_order_iterates_in_tiles(seq, dtype):
    torch.manual_seed(0)
    k = torch.randn(2, seq, 3, 32, dtype=dtype)
    cos, sin = torch.randn(seq, 32, dtype=dtype), torch.randn(seq, 32, dtype=dtype)
    compiled = eqfuse.compile(_rotary_into_transposed_copy, [k, cos, sin])
    assert_matches(compiled(k, cos, sin), _rotary_into_transposed_copy(k, cos, sin))
    (kernel,) = compiled.kernels
    assert kernel.schedule.inner == seq  # the transposed read's unit-stride digit starts at seq
    assert "yindex = " in kernel.source and kernel.constexprs["X"] == seq


def test_reads_in_output_order_stay_flat():
    x = torch.randn(4, 48, 40)
    compiled = eqfuse.compile(lambda t: (t * 2).transpose(0, 1).contiguous(), [x])
    (kernel,) = compiled.kernels
    assert kernel.schedule.inner == 0 and "yindex" not in kernel.source  # rows move, columns stay in order


def _bias_and_weight_grads(dy, x, dz):
    """A linear layer's bias gradient, a norm's weight gradient (both summed over tokens),
    and one read through a cat of two gradients (a fused qkv projection's bias)."""
    return dy.sum(0), (dy * x).sum(0), torch.cat([dy, dz], dim=1).sum(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(300, 257), (17, 300), (1000, 33)], ids=lambda s: "x".join(map(str, s)))
def test_sums_over_tokens_tile_across_rows(shape, dtype):
    torch.manual_seed(0)
    dy, x, dz = (torch.randn(*shape, dtype=dtype) for _ in range(3))
    compiled = eqfuse.compile(_bias_and_weight_grads, [dy, x, dz])
    assert_matches(compiled(dy, x, dz), _bias_and_weight_grads(dy, x, dz))
    tokens = shape[0]
    for kernel in compiled.kernels:
        # a column of >= 256 tokens is read by tiles many features wide; shorter ones stay whole
        assert kernel.schedule.columns == (tokens >= 256), kernel.schedule
        if kernel.schedule.columns:
            assert kernel.constexprs["BLOCK_R"] >= 16 and "for c0 in range" in kernel.source


def test_a_row_reduction_read_along_its_rows_stays_whole():
    x = torch.randn(64, 300)
    compiled = eqfuse.compile(lambda t: torch.softmax(t, -1), [x])
    (kernel,) = compiled.kernels
    assert not kernel.schedule.columns and kernel.schedule.persistent


def test_a_sum_of_values_read_once_per_row_keeps_rows_per_program():
    """A cross-entropy's backward: its sum over the one-hot reads only the targets (one
    value a row, unit stride along the rows), while the gradient it writes reads the
    logits along the rows' length; tiles across rows would read those a sector apart."""
    def ce_backward(logits, lse, target, scale):
        cols = torch.arange(logits.shape[1])
        onehot = torch.where(cols == target[:, None], scale, 0.0)
        return onehot - torch.exp(logits - lse[:, None]) * onehot.sum(1, keepdim=True)

    torch.manual_seed(0)
    logits, target = torch.randn(64, 300), torch.randint(0, 300, (64,))
    inputs = [logits, torch.logsumexp(logits, 1), target, torch.tensor(-1 / 64)]
    compiled = eqfuse.compile(ce_backward, inputs)
    assert_matches(compiled(*inputs), ce_backward(*inputs))
    (kernel,) = [k for k in compiled.kernels if k.schedule.kind == "reduction"]
    assert not kernel.schedule.columns, kernel.schedule


def test_a_cat_branch_keeps_the_digit_structure_of_its_index():
    """Below a cat, the shifted index is a digit of its own: a reshape under the branch
    splits it exactly instead of unravelling the linear index (whose divisions hide
    contiguity from Triton)."""
    from eqfuse.codegen.indexing import Idx, env_of, reshape_env, shifted_env
    r, c = Idx("rindex", frozenset("r")), Idx("cindex", frozenset("c"))
    env = env_of([(r, 4), (c, 10)], (4, 10))
    branch = shifted_env(env, 1, 4, (4, 6), Idx("(cindex >= 4)", frozenset("c")))
    assert branch.groups is not None
    split = reshape_env(branch, (4, 2, 3))
    assert [d.expr for d in split.dims] == ["rindex", "((cindex - 4) // 3)", "((cindex - 4) % 3)"]


@pytest.mark.parametrize("strides", [(48, 16, 4, 1), (4, 8, 24, 1), (96, 32, 1, 2), (0, 16, 4, 1)])
def test_an_offset_is_the_address_of_every_point(strides):
    """Digits of one kernel index that neighbour in the index and in memory are one term
    (rows padded to 16: ``mindex * 16``, not ``(mindex // 3) * 48 + (mindex % 3) * 16``);
    whatever merges, the offset is the address at every point."""
    from eqfuse.codegen.indexing import Idx, env_of, reshape_env, strided_offset
    m, n = Idx("mindex", frozenset("m")), Idx("nindex", frozenset("n"))
    env = reshape_env(env_of([(m, 6), (n, 8)], (6, 8)), (2, 3, 2, 4))
    off = strided_offset(env, strides, (2, 3, 2, 4))
    if strides == (48, 16, 4, 1):
        assert off.expr == "mindex * 16 + nindex"
    for mi in range(6):
        for ni in range(8):
            point = (mi // 3, mi % 3, ni // 4, ni % 4)
            assert eval(off.expr, {"mindex": mi, "nindex": ni}) == sum(p * st for p, st in zip(point, strides))


def test_qkv_gradients_through_a_cat_match_eager():
    def fused_qkv_grad(dq, dk, dv):
        b, h, s, d = dq.shape
        return torch.cat([t.transpose(1, 2).reshape(b, s, h * d) for t in (dq, dk, dv)], -1).sum((0, 1))

    torch.manual_seed(0)
    grads = [torch.randn(2, 3, 100, 8) for _ in range(3)]
    compiled = eqfuse.compile(fused_qkv_grad, grads)
    assert_matches(compiled(*grads), fused_qkv_grad(*grads))


def test_a_concatenation_along_the_rows_iterates_over_row_tiles():
    """cat([a, b, c], -1) stored: a 2-D iteration over [rows, row length], so each part's
    read indexes by the tile's own column instead of unravelling the flat index (GPT-2's
    backward joins the q/k/v gradients so); matches eager at ragged sizes."""
    def join(a, b, c):
        return torch.cat([a, b, c], -1).reshape(-1, 3 * a.shape[-1]) * 2
    a, b, c = (torch.randn(3, 37, 24) for _ in range(3))
    compiled = eqfuse.compile(join, (a, b, c))
    assert_matches(compiled(a, b, c), join(a, b, c))
    (kernel,) = compiled.kernels
    assert kernel.schedule.kind == "pointwise" and kernel.schedule.inner == 72, kernel.schedule


def test_intermediate_buffers_are_let_go_of_after_their_last_use():
    # Three products in a chain: each intermediate is dead once the next product has read
    # it, and the module drops it there (the caching allocator then reuses its memory);
    # the returned buffer is never dropped.
    def chain(x, w):
        h1 = torch.relu(x @ w)
        h2 = torch.relu(h1 @ w)
        return (h2 @ w).sum(-1), h1.amax(-1)

    x, w = torch.randn(33, 24), torch.randn(24, 24)
    c = eqfuse.compile(chain, (x, w))
    assert_matches(c(x, w), chain(x, w))
    body = c.source.split("def call_boxed(")[1]
    lines = [line.strip() for line in body.splitlines()]
    dels = [line for line in lines if line.startswith("del ")]
    assert dels, body
    returned = lines[-1].removeprefix("return [").removesuffix("]").split(", ")
    freed = {name for line in dels for name in line.removeprefix("del ").split(", ")}
    assert not freed & set(returned)
    assert {"in0", "in1"} <= freed  # the inputs too: call_boxed holds the only references it was handed
    for name in freed:  # nothing reads a buffer after it is dropped
        after = lines[next(i for i, line in enumerate(lines) if line.startswith("del ") and name in line) + 1:]
        assert not any(re.search(rf"\b{name}\b", line) for line in after), name


def test_call_boxed_empties_its_list_and_lets_go_of_the_inputs():
    import gc
    import weakref

    def f(x, w):
        return torch.relu(x @ w).sum(-1)

    x, w = torch.randn(33, 24), torch.randn(24, 24)
    c = eqfuse.compile(f, (x, w))
    ref = f(x, w)
    args = [x.clone(), w]
    gone = weakref.ref(args[0])
    out = c.call_boxed(args)
    gc.collect()
    assert args == [] and gone() is None  # the graph held the only reference to x's copy
    assert_matches(out, ref)
