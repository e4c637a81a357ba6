"""Matrix products against eager PyTorch on the Triton interpreter: every matmul example at
odd sizes (none a multiple of a block), three dtypes, transposed and batched operands,
kernel counts, and the cases eqfuse leaves to eager."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, assert_matches

import eqfuse
from eqfuse.codegen import configs
from eqfuse.examples import MATMUL_EXAMPLES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [(1, 17, 100), (17, 100, 257), (100, 257, 1), (257, 1, 17)]  # (M, N, K)


def compiled_and_checked(fn, inputs):
    compiled = eqfuse.compile(fn, inputs)
    assert_matches(compiled(*inputs), fn(*inputs), contraction=True)
    return compiled


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(MATMUL_EXAMPLES))
def test_matmul_example_matches_eager(name, size, dtype):
    ex = MATMUL_EXAMPLES[name]
    torch.manual_seed(0)
    inputs = ex.make_inputs(*size, dtype, DEVICE)
    compiled = compiled_and_checked(ex.fn, inputs)
    assert len(compiled.kernels) <= ex.kernels, compiled.explain()
    assert compiled.fallbacks == []
    assert "tl.dot" in compiled.source


def test_gelu_linear_is_one_kernel_with_everything_in_the_epilogue():
    ex = MATMUL_EXAMPLES["linear_gelu"]
    inputs = ex.make_inputs(33, 48, 40, torch.float16, DEVICE)
    compiled = compiled_and_checked(ex.fn, inputs)
    (k,) = compiled.kernels
    assert k.schedule.kind == "matmul"
    body = k.source
    assert body.index("tl.erf") > body.index("tl.dot")  # gelu after the K loop, on the accumulator


def test_swiglu_mlp_computes_both_products_in_one_loop():
    ex = MATMUL_EXAMPLES["swiglu_mlp"]
    inputs = ex.make_inputs(40, 72, 24, torch.float16, DEVICE)
    compiled = compiled_and_checked(ex.fn, inputs)
    assert len(compiled.kernels) == 2
    first = compiled.kernels[0]
    assert first.schedule.dots == 2 and first.source.count("tl.dot(") == 2
    assert first.source.count("for k0 in range") == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", [(), (3,)], ids=["unbatched", "batched"])
def test_summed_products_share_one_accumulator(batch, dtype):
    """A backward's input gradient through three projections, ``dq @ Wq + dk @ Wk + dv @ Wv``,
    plus a residual: one kernel, one accumulator, one K loop over the three K ranges (the
    reads share a layout: each step picks its product's buffers)."""
    def grad_through_projections(a, b, c, wa, wb, wc, r):
        return a @ wa + b @ wb + c @ wc + r

    torch.manual_seed(0)
    m, k, n = 17, 100, 33
    inputs = [torch.randn(*batch, m, k, dtype=dtype, device=DEVICE) for _ in range(3)]
    inputs += [torch.randn(k, n, dtype=dtype, device=DEVICE) for _ in range(3)]
    inputs.append(torch.randn(*batch, m, n, dtype=dtype, device=DEVICE))
    compiled = compiled_and_checked(grad_through_projections, inputs)
    (kernel,) = compiled.kernels
    assert kernel.schedule.summed and kernel.schedule.dots == 3
    assert kernel.source.count("tl.zeros([BLOCK_M, BLOCK_N]") == 1
    assert kernel.source.count("for k1 in range(0, 3 * ") == 1 and kernel.source.count("tl.dot(") == 1


def test_summed_products_with_reads_of_different_layouts_loop_apart():
    """``a @ wa + bt.T @ wb``: the left operands are read in different layouts (one
    transposed), so no single loop picks between them: a K loop per product, still one
    accumulator, and the K ranges ragged (100 is no multiple of the block)."""
    def two_projections(a, bt, wa, wb):
        return a @ wa + bt.t() @ wb

    torch.manual_seed(0)
    inputs = [torch.randn(17, 100, device=DEVICE), torch.randn(100, 17, device=DEVICE),
              torch.randn(100, 33, device=DEVICE), torch.randn(100, 33, device=DEVICE)]
    compiled = compiled_and_checked(two_projections, inputs)
    (kernel,) = compiled.kernels
    assert kernel.schedule.summed and kernel.schedule.dots == 2
    assert kernel.source.count("tl.zeros([BLOCK_M, BLOCK_N]") == 1
    assert kernel.source.count("for k0 in range") == 2


def test_products_used_apart_keep_their_own_accumulators():
    """``(a @ w) * (a @ v)`` is not a sum: each product keeps its accumulator."""
    def gated(a, w, v):
        return (a @ w) * (a @ v) + a @ w

    inputs = [torch.randn(20, 24, device=DEVICE)] + [torch.randn(24, 40, device=DEVICE) for _ in range(2)]
    compiled = compiled_and_checked(gated, inputs)
    assert all(not k.schedule.summed for k in compiled.kernels)


@pytest.mark.parametrize("which", ["a", "b", "both"])
def test_transposed_operands_are_read_through_strides(which):
    a, b = torch.randn(37, 20), torch.randn(20, 45)
    if which in ("a", "both"):
        a = a.t().contiguous().t()
    if which in ("b", "both"):
        b = b.t().contiguous().t()
    compiled = compiled_and_checked(torch.matmul, (a, b))
    assert len(compiled.kernels) == 1


def test_x_at_w_transposed_is_a_stride_change():
    def f(x, w):
        return x @ w.T
    x, w = torch.randn(30, 20), torch.randn(50, 20)
    compiled = compiled_and_checked(f, (x, w))
    assert len(compiled.kernels) == 1
    assert "kindex_b + nindex * 20" in compiled.source.replace("kindex_b * 1 ", "kindex_b ")


@pytest.mark.parametrize("shapes", [((3, 4, 5, 8), (8, 6)), ((3, 1, 5, 8), (4, 8, 6)), ((2, 5, 8), (2, 8, 7))],
                         ids=["4d-by-2d", "broadcast-batch", "bmm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batched_matmul(shapes, dtype):
    a, b = (torch.randn(s, dtype=dtype) for s in shapes)
    compiled = compiled_and_checked(torch.matmul, (a, b))
    assert len(compiled.kernels) == 1


def test_einsum_with_transposed_output_is_one_kernel():
    def f(q, k):
        return torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.3
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8)
    compiled = compiled_and_checked(f, (q, k))
    assert len(compiled.kernels) == 1


def test_prologue_with_nonzero_padding_is_masked():
    """(a + 1) @ (b + 1) with K = 17: past the end of K both operands must be zero, not 1."""
    def f(a, b):
        return (a + 1) @ (b + 1)
    a, b = torch.randn(20, 17), torch.randn(17, 24)
    compiled = compiled_and_checked(f, (a, b))
    assert len(compiled.kernels) == 1
    assert "kmask_a" in compiled.source


def test_reciprocal_prologue_does_not_leak_infinities():
    """1 / a is infinite in the padding (a = 0 there); the padding must not reach the sum."""
    def f(a, b):
        return (1 / a) @ b
    a, b = torch.rand(8, 19) + 0.5, torch.randn(19, 8)
    compiled_and_checked(f, (a, b))


@pytest.mark.parametrize("beta,alpha", [(1, 1), (0.5, 2.0), (0, 1)])
def test_addmm_scales(beta, alpha):
    def f(c, a, b):
        return torch.addmm(c, a, b, beta=beta, alpha=alpha)
    c, a, b = torch.randn(9, 11), torch.randn(9, 13), torch.randn(13, 11)
    if beta == 0:
        c[0, 0] = float("nan")  # ignored when beta is 0, as in torch
    compiled = compiled_and_checked(f, (c, a, b))
    assert len(compiled.kernels) == 1


def test_linear_on_3d_input_keeps_the_epilogue_fused():
    def f(x, w, b):
        return F.gelu(F.linear(x, w, b))
    x, w, b = torch.randn(2, 5, 8), torch.randn(6, 8), torch.randn(6)
    compiled = compiled_and_checked(f, (x, w, b))
    assert len(compiled.kernels) == 1


def test_fp32_precision_follows_allow_tf32():
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert 'input_precision="ieee"' in eqfuse.compile(torch.matmul, (a, b)).source
        torch.backends.cuda.matmul.allow_tf32 = True
        assert 'input_precision="tf32"' in eqfuse.compile(torch.matmul, (a, b)).source
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def test_turning_tf32_off_after_compiling_compiles_again():
    """A graph compiled with TF32 allowed, called after the user turned it off, runs a
    variant compiled for IEEE float32, not the TF32 kernels."""
    a, b = torch.randn(20, 30, device=DEVICE), torch.randn(30, 12, device=DEVICE)
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        compiled = eqfuse.compile(torch.matmul, (a, b))
        assert 'input_precision="tf32"' in compiled.source
        torch.backends.cuda.matmul.allow_tf32 = False
        assert_matches(compiled(a, b), a @ b, contraction=True)
        sources = [v.source for v in compiled._variants.values()]
        assert len(sources) == 2 and any('input_precision="ieee"' in src for src in sources)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old



@pytest.mark.parametrize("dtype,reason", [
    pytest.param(torch.int32, "matmul of int32",
                 marks=pytest.mark.skipif(DEVICE == "cuda", reason="CUDA has no integer matmul to compare with")),
    (torch.float64, "matmul of float64")])
def test_unsupported_matmul_runs_in_eager_with_a_reason(dtype, reason):
    def f(a, b):
        return (a @ b) + 1
    a = torch.randint(-3, 3, (5, 6)).to(dtype)
    b = torch.randint(-3, 3, (6, 4)).to(dtype)
    compiled = eqfuse.compile(f, (a, b))
    assert torch.equal(compiled(a, b), f(a, b))
    assert any(reason in f.reason for f in compiled.fallbacks), compiled.fallbacks


def test_matmul_feeding_a_matmul_is_two_kernels():
    def f(a, b, c):
        return (a @ b) @ c
    a, b, c = torch.randn(10, 12), torch.randn(12, 14), torch.randn(14, 9)
    compiled = compiled_and_checked(f, (a, b, c))
    assert len(compiled.kernels) == 2


def test_a_chosen_tile_configuration_is_used_and_agrees():
    """Any runnable tile shape computes the same product (here 20 tiles with ragged edges
    and an epilogue); one that is not runnable is refused for the default."""
    from eqfuse.codegen.module import generate_module
    from eqfuse.runtime.cache import cache_key, load_module
    ex = MATMUL_EXAMPLES["linear_gelu"]
    inputs = ex.make_inputs(70, 50, 40, torch.float32, DEVICE)
    compiled = eqfuse.compile(ex.fn, inputs)
    (k,) = compiled.kernels
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 3}
    source, infos = generate_module(compiled.plan, "tiles", "test", {k.name: cfg})
    assert infos[0].grid == (20, 1) and infos[0].constexprs["GROUP_M"] == 2
    module = load_module(cache_key(source), source, interpret=DEVICE == "cpu")
    (out,) = module.call(inputs[0].device, [], *inputs)
    assert_matches(out, ex.fn(*inputs), contraction=True)
    _, infos = generate_module(compiled.plan, "tiles", "test", {k.name: {**cfg, "BLOCK_M": 24}})
    assert infos[0].constexprs["BLOCK_M"] != 24


# --- the TMA form (codegen/tma.py): which matmuls get it, and that it computes the same ---

TMA_CFG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 3, "PROGRAMS": 3}


def _kernel(fn, inputs):
    compiled = eqfuse.compile(fn, inputs)
    return compiled, compiled.kernels[0]


def _mm(a, b):
    return a @ b


@pytest.mark.parametrize("case,expected", [
    ("fp16 row-major", True),
    ("bf16 x @ w.T", True),
    ("fp32 K=8 (32-byte rows)", True),
    ("fp16 K=17 (34-byte rows)", False),
    ("fp32 K=6 (24-byte rows)", False),
    ("fp16 column-major A", True),
    ("3-D input of a linear", True),
    ("batched", True),
    ("prologue on A", False),
    ("sliced A (offset of 2 elements)", False),
    ("sliced A (offset of 8 elements)", True),
])
def test_which_matmuls_can_take_the_tma_form(case, expected):
    """TMA takes a plain read whose tile is a 2-D box with a contiguous dim, its other
    stride and its offset multiples of 16 bytes (a batched one a 3-D box: more in
    test_tma_batched.py); nothing computed."""
    h, bf, f = torch.float16, torch.bfloat16, torch.float32
    cases = {
        "fp16 row-major": (_mm, (torch.randn(40, 64, dtype=h), torch.randn(64, 48, dtype=h))),
        "bf16 x @ w.T": (lambda x, w: x @ w.T, (torch.randn(40, 64, dtype=bf), torch.randn(48, 64, dtype=bf))),
        "fp32 K=8 (32-byte rows)": (_mm, (torch.randn(40, 8, dtype=f), torch.randn(8, 48, dtype=f))),
        "fp16 K=17 (34-byte rows)": (_mm, (torch.randn(40, 17, dtype=h), torch.randn(17, 48, dtype=h))),
        "fp32 K=6 (24-byte rows)": (_mm, (torch.randn(40, 6, dtype=f), torch.randn(6, 48, dtype=f))),
        "fp16 column-major A": (_mm, (torch.randn(64, 40, dtype=h).t(), torch.randn(64, 48, dtype=h))),
        "3-D input of a linear": (lambda x, w: F.linear(x, w), (torch.randn(2, 20, 64, dtype=h),
                                                               torch.randn(48, 64, dtype=h))),
        "batched": (_mm, (torch.randn(2, 40, 64, dtype=h), torch.randn(2, 64, 48, dtype=h))),
        "prologue on A": (lambda a, b: (a * 2 + 1) @ b, (torch.randn(40, 64, dtype=h), torch.randn(64, 48, dtype=h))),
        "sliced A (offset of 2 elements)": (lambda a, b: a[:, 2:] @ b, (torch.randn(40, 66, dtype=h),
                                                                        torch.randn(64, 48, dtype=h))),
        "sliced A (offset of 8 elements)": (lambda a, b: a[:, 8:] @ b, (torch.randn(40, 72, dtype=h),
                                                                        torch.randn(64, 48, dtype=h))),
    }
    fn, inputs = cases[case]
    _, k = _kernel(fn, inputs)
    assert k.schedule.kind == "matmul"
    assert k.schedule.tma is expected, k.source


def test_tma_configs_are_offered_only_where_the_device_and_the_matmul_take_them(monkeypatch):
    from eqfuse.codegen import tiles, tma
    from eqfuse.codegen.schedules import Schedule
    _, k = _kernel(_mm, (torch.randn(512, 256, dtype=torch.float16), torch.randn(256, 384, dtype=torch.float16)))
    h = torch.float16
    # Batched with a long K: the K loop outlasts the store, nothing for the TMA form to overlap
    _, batched = _kernel(_mm, (torch.randn(2, 64, 1024, dtype=h), torch.randn(2, 1024, 64, dtype=h)))
    _, computed = _kernel(lambda a, b: (a * 2 + 1) @ b, (torch.randn(40, 64, dtype=h), torch.randn(64, 48, dtype=h)))
    monkeypatch.setattr(tma, "device_supports", lambda: False)
    assert not any("PROGRAMS" in c for c in tiles.candidates(k.schedule))
    monkeypatch.setattr(tma, "device_supports", lambda: True)
    monkeypatch.setattr(tma, "sm_count", lambda: 132)
    cands = tiles.candidates(k.schedule)
    tma_cands = [c for c in cands if "PROGRAMS" in c]
    assert tma_cands and len(tma_cands) < len(cands)  # both forms
    # each tile shape in both forms. With at most one tile an SM, the TMA form overlaps
    # nothing and first makes its descriptors: its twin ranks ahead (H100, 1024^3: 14.0 us
    # against 10.5). With many tiles an SM its overlap wins (H100, [16384 x 4096] @ [4096 x
    # 4096], 128 x 256 tiles: 734 us against 863)
    big = Schedule("matmul", m=16384, n=4096, k=4096, dot_dtype="float16", dots=1, tma=True)
    big_tma = [c for c in tiles.candidates(big) if "PROGRAMS" in c]
    for sched, offered, ahead in ((k.schedule, tma_cands, False), (big, big_tma, True)):
        for c in offered:
            plain = {key: v for key, v in c.items() if key != "PROGRAMS"}
            assert plain in tiles.candidates(sched)
            tiles_count = -(-sched.m // c["BLOCK_M"]) * -(-sched.n // c["BLOCK_N"])
            assert c["PROGRAMS"] == min(132, tiles_count)
            if c["BLOCK_M"] * c["BLOCK_N"] == 128 * 256:
                faster = tiles.modelled_time_us(sched, c) < tiles.modelled_time_us(sched, plain)
                assert faster is ahead, (sched.m, c)
    assert "PROGRAMS" in tiles.ranked(big)[0] and "PROGRAMS" in configs.tuning_candidates(big)[0]
    assert batched.schedule.tma and not any("PROGRAMS" in c for c in tiles.candidates(batched.schedule))
    # Two products in one loop: the form runs (forced), but is not offered (slower on an H100)
    swiglu = MATMUL_EXAMPLES["swiglu_mlp"]
    compiled = eqfuse.compile(swiglu.fn, swiglu.make_inputs(64, 64, 64, torch.float16, DEVICE))
    two = compiled.kernels[0].schedule
    assert two.dots == 2 and two.tma and configs.fits(two, TMA_CFG)
    assert not any("PROGRAMS" in c for c in tiles.candidates(two))
    # A cached or user config in the TMA form is refused for a matmul that cannot take it
    assert configs.fits(k.schedule, TMA_CFG) and not configs.fits(computed.schedule, TMA_CFG)
    assert not configs.fits(k.schedule, {**TMA_CFG, "PROGRAMS": 0})


def _tma_module(compiled, kernel_name, cfg=TMA_CFG):
    from eqfuse.codegen.module import generate_module
    from eqfuse.runtime.cache import cache_key, load_module
    source, infos = generate_module(compiled.plan, "tma", "test", {kernel_name: cfg})
    return load_module(cache_key(source), source, interpret=DEVICE == "cpu"), source, infos


def _loop_body(source: str, head: str) -> list[str]:
    """The lines of the loop that begins with ``head`` in a kernel's source."""
    lines = source.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(head))
    indent = len(lines[at]) - len(lines[at].lstrip())
    body = []
    for line in lines[at + 1:]:
        if len(line) - len(line.lstrip()) <= indent:
            break
        body.append(line)
    return body


@pytest.mark.parametrize("name,size", [("linear_gelu", (70, 48, 40)), ("linear_residual", (33, 64, 48)),
                                       ("swiglu_mlp", (40, 64, 32)), ("matmul", (64, 32, 24))])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tma_form_matches_eager(name, size, dtype):
    """The persistent TMA form, forced with a config on any device (the interpreter runs
    descriptors too): ragged tiles (zeros past the edges), transposed weights, two
    products in one loop, an epilogue, stores through descriptors."""
    ex = MATMUL_EXAMPLES[name]
    torch.manual_seed(0)
    inputs = ex.make_inputs(*size, dtype, DEVICE)
    compiled = eqfuse.compile(ex.fn, inputs)
    first = compiled.kernels[0]
    assert first.schedule.tma, first.source
    module, source, infos = _tma_module(compiled, first.name)
    info = next(i for i in infos if i.name == first.name)
    assert info.grid == (3, 1) and info.fallback is not None
    kernel_src = info.source
    assert "tl.make_tensor_descriptor" in kernel_src and "flatten=True" in kernel_src
    assert ".store([pid_m * BLOCK_M" in kernel_src  # the output tile through a descriptor
    assert "tl.load(" not in "\n".join(_loop_body(kernel_src, "for k0"))  # no pointer loads in the K loop
    # gelu's erf and silu's sigmoid make the epilogue run on half tiles (registers), with
    # each accumulator split; an add or nothing does not
    assert ("for half in tl.static_range(2)" in kernel_src) == (name in ("linear_gelu", "swiglu_mlp")), kernel_src
    (out,) = module.call(inputs[0].device, [], *inputs)
    assert_matches(out, ex.fn(*inputs), contraction=True)


def test_tma_kernel_runs_its_pointer_twin_for_an_unaligned_input():
    """TMA wants 16-byte aligned addresses; an input that starts elsewhere (a view one
    element in) is computed by the same tiles without TMA, and right."""
    ex = MATMUL_EXAMPLES["linear_gelu"]
    x, w, b = ex.make_inputs(64, 48, 40, torch.float16, DEVICE)
    compiled = eqfuse.compile(ex.fn, (x, w, b))
    module, _, _ = _tma_module(compiled, compiled.kernels[0].name)
    launcher = getattr(module, f"{compiled.kernels[0].name}_launch")
    calls = []
    twin = launcher.otherwise
    launcher.otherwise = lambda *t: (calls.append(1), twin(*t))
    (aligned_out,) = module.call(x.device, [], x, w, b)
    assert calls == []
    storage = torch.empty(x.numel() + 1, dtype=x.dtype)
    shifted = storage[1:].view_as(x)
    shifted.copy_(x)
    assert shifted.data_ptr() % 16
    (out,) = module.call(x.device, [], shifted, w, b)
    assert calls == [1]
    assert torch.equal(out, aligned_out)
    assert_matches(out, ex.fn(x, w, b), contraction=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_tma_form_on_the_gpu(dtype):
    """On a Hopper GPU: the TMA kernel compiled, launched through its C launcher with its
    descriptor scratch (first call through the JIT, later ones direct), replayed from a
    CUDA graph, and its pointer twin for an unaligned input."""
    from eqfuse.codegen import tma
    if not tma.device_supports():
        pytest.skip("TMA needs compute capability 9.0")
    ex = MATMUL_EXAMPLES["linear_gelu"]
    torch.manual_seed(0)
    x, w, b = ex.make_inputs(1000, 384, 256, dtype, DEVICE)
    compiled = eqfuse.compile(ex.fn, (x, w, b))
    cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 8, "num_stages": 3,
           "PROGRAMS": 7}
    module, _, _ = _tma_module(compiled, compiled.kernels[0].name, cfg)
    ref = ex.fn(x, w, b)
    for _ in range(3):
        (out,) = module.call(x.device, [], x, w, b)
        assert_matches(out, ref, contraction=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (captured,) = module.call(x.device, [], x, w, b)
    x.copy_(x * 0.5)
    graph.replay()
    assert_matches(captured, ex.fn(x, w, b), contraction=True)
    shifted = torch.empty(x.numel() + 1, dtype=dtype)[1:].view_as(x)
    shifted.copy_(x)
    (out,) = module.call(x.device, [], shifted, w, b)
    assert_matches(out, ex.fn(x, w, b), contraction=True)
    # And the autotuner, offered both forms, picks a runnable one that agrees
    assert_matches(compiled(x, w, b), ex.fn(x, w, b), contraction=True)


def test_tile_model_hides_a_short_k_matmuls_store_behind_other_programs():
    """q @ k^T at head dim 128 writes far more than it computes: the model ranks first a
    tile of which an SM holds several (one's store overlaps another's loads); a long-K
    matmul keeps the big tile."""
    from eqfuse.codegen import tiles
    from eqfuse.codegen.schedules import Schedule
    scores = Schedule("matmul", batch=(256,), m=2048, n=2048, k=128, dot_dtype="float16", dots=1)
    best = tiles.ranked(scores)[0]
    assert tiles.resident(scores, best) > 1
    big = tiles.ranked(Schedule("matmul", m=8192, n=4096, k=4096, dot_dtype="float16", dots=1))[0]
    assert (big["BLOCK_M"], big["BLOCK_N"]) in ((128, 256), (256, 128))


def _gpt2_product(m, n, k, **kw):
    from eqfuse.codegen.schedules import Schedule
    return Schedule("matmul", m=m, n=n, k=k, dot_dtype="float16", dots=1, tma=True, **kw)


def _tile(cfg):
    return (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"], cfg["num_stages"], "PROGRAMS" in cfg)


@pytest.mark.parametrize("shape, reads, expected", [
    # The fastest of every candidate timed on an H100 (benchmarks/results/matmul-tile-sweep_*.json)
    ((8192, 3072, 768), 0, (128, 256, 64, 8, 3, True)),  # GPT-2 gelu(x @ W + b): 85.8 us
    ((8192, 768, 3072), 1, (128, 128, 64, 8, 5, True)),  # + residual: 74.0 (4 stages 77.3, 3 91.7)
    # gelu backward: 125.2 (two programs an SM, 128 x 128 x 64 w8 s3, 118.6; the narrow-tile
    # rate that keeps Llama's long-K weight gradients on 128 x 256 tiles costs this one 5%)
    ((8192, 3072, 768), 1, (128, 256, 64, 8, 3, True)),
    ((3072, 768, 8192), 0, (128, 256, 64, 8, 4, False)),  # weight gradient, 72 tiles: 83.0 (TMA 85.5)
    ((768, 768, 8192), 0, (64, 128, 128, 4, 3, False)),  # 72 tiles: 41.8 (128 x 64 in the TMA form 48.0)
    ((2304, 768, 8192), 0, (128, 128, 64, 8, 5, False)),  # 108 tiles: 48.9 (TMA 52.9)
    ((16384, 4096, 4096), 0, (128, 256, 64, 8, 3, True)),  # Llama: 734 (no TMA 863)
])
def test_tile_model_first_choice_at_gpt2_and_llama_sizes(monkeypatch, shape, reads, expected):
    """The model's arithmetic (default device figures, 132 SMs), checked against the
    configurations an H100 ran fastest."""
    from eqfuse.codegen import tiles, tma
    monkeypatch.setattr(tma, "device_supports", lambda: True)
    monkeypatch.setattr(tma, "sm_count", lambda: 132)
    assert _tile(tiles.ranked(_gpt2_product(*shape, tile_reads=reads))[0]) == expected


def test_tile_model_terms(monkeypatch):
    """Each term of the model moves the time the way the H100 measurements did."""
    from eqfuse.codegen import tiles, tma
    from eqfuse.codegen.schedules import Schedule
    monkeypatch.setattr(tma, "device_supports", lambda: True)
    monkeypatch.setattr(tma, "sm_count", lambda: 132)
    llama = _gpt2_product(16384, 4096, 4096)
    tma_form = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "PROGRAMS": 132}
    # Loads in flight: one program an SM with 3 stages has too few to cover their latency (1075 us against 796, 809)
    by_stages = [tiles.modelled_time_us(llama, {**tma_form, "num_stages": s}) for s in (3, 4, 5)]
    assert by_stages[0] > 1.15 * by_stages[1] and by_stages[1] >= by_stages[2]
    # The TMA form never with 2 stages (1.4-2x slower than 3 wherever timed)
    assert all(c["num_stages"] >= tiles.MIN_TMA_STAGES for c in tiles.candidates(llama) if "PROGRAMS" in c)
    # Two programs an SM hide one's epilogue read behind the other's loop, at a cost to both
    # loops: over a short K loop (the gelu backward) they win over one program an SM
    backward = _gpt2_product(8192, 3072, 768, tile_reads=1)
    first = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
    assert tiles.resident(backward, first) == 2 and tiles.resident(backward, {**first, "num_stages": 4}) == 1
    assert tiles.modelled_time_us(backward, first) < tiles.modelled_time_us(backward, {**first, "num_stages": 4})
    # Tiles under 256 columns compute at a lower rate (A re-read from shared memory per
    # product instruction): Llama's long-K weight gradient stays on 128 x 256 tiles (about
    # 1990 us, against 2500 for the 128 x 128 tiles with 5 stages the model once chose)
    wgrad = _gpt2_product(11008, 4096, 16384)
    assert _tile(tiles.ranked(wgrad)[0]) == (128, 256, 64, 8, 3, True)
    # ... while over a long K loop, sharing the SM costs more than it hides (77.3 us against 71.2)
    long_k = _gpt2_product(8192, 768, 3072)
    two, one = ({**first, "num_stages": stages} for stages in (3, 4))
    assert tiles.resident(long_k, two) == 2 and tiles.resident(long_k, one) == 1
    assert tiles.modelled_time_us(long_k, two) > tiles.modelled_time_us(long_k, one)
    # Fewer busy SMs clock higher: the same 128 x 256 tile computes faster with 72 tiles than with all SMs busy
    tile = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}
    few, many = _gpt2_product(3072, 768, 8192), _gpt2_product(128 * 132, 256, 8192)
    assert tiles.modelled_time_us(few, tile) < tiles.modelled_time_us(many, tile)
    # Two products side by side (SwiGLU): not on 4 warps (256 accumulator registers a thread
    # spilled: 9644 us against 2356), and at Llama's 16384 tokens slower than the products apart
    dual = Schedule("matmul", m=16384, n=11008, k=4096, dot_dtype="float16", dots=2, tma=True)
    assert all(c["num_warps"] == 8 for c in tiles.candidates(dual) if c["BLOCK_M"] * c["BLOCK_N"] == 128 * 128)
    apart = [_gpt2_product(16384, 11008, 4096), _gpt2_product(16384, 11008, 4096, tile_reads=1)]
    modelled = lambda sched: tiles.modelled_time_us(sched, tiles.ranked(sched)[0])  # noqa: E731
    assert modelled(dual) > sum(map(modelled, apart))


def test_single_stage_last_resorts_are_new_pipelined_tiles():
    from eqfuse.codegen.configs import single_stage
    a = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 4}
    b = {**a, "num_stages": 3}
    tma = {**a, "PROGRAMS": 132}
    assert single_stage([a, b, tma]) == [{**a, "num_stages": 1}]  # once; never the TMA form
    assert single_stage([a, {**a, "num_stages": 1}]) == []  # already among the candidates
