"""Plain products as library calls (eqfuse/codegen/library.py): a kernel that is one
matrix product of operands read as stored becomes ``torch.mm`` / ``torch.bmm`` writing into
its planned buffer; anything fused around a product, or a layout cuBLAS would copy, keeps
the generated kernel.

On a GPU that is cuBLAS; here ``FORCE`` makes the same calls on the CPU (torch's CPU BLAS),
which checks the plan rewrite and the steps around the calls: views, the buffer written,
the kernels reading it."""

import pytest
import torch
from conftest import DEVICE, assert_matches

import eqfuse
from eqfuse.codegen import library
from eqfuse.schema.plan import step_reads


@pytest.fixture
def cublas(monkeypatch):
    """Library calls on, on the CPU too."""
    monkeypatch.setattr(library, "FORCE", True)
    monkeypatch.delenv(library.ENV, raising=False)


def _calls(compiled) -> list[tuple[str, str]]:
    return [(c.op, c.description) for c in compiled.library_calls]


def _check(fn, inputs, kernels: int, calls: list):
    compiled = eqfuse.compile(fn, inputs)
    assert_matches(compiled(*inputs), fn(*inputs), contraction=True)
    assert len(compiled.kernels) == kernels, compiled.explain()
    assert [op for op, _ in _calls(compiled)] == calls, compiled.explain()
    return compiled


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m, k, n", [(17, 104, 40), (1, 256, 24), (100, 1, 8)])
def test_plain_product_is_one_call(cublas, dtype, m, k, n):
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    compiled = _check(torch.matmul, [a, b], kernels=0, calls=["mm"])
    assert _calls(compiled) == [("mm", f"[{m} x {k}] @ [{k} x {n}] {str(dtype)[6:]}")]
    assert "cuBLAS k0_mm: torch.mm" in compiled.explain()
    assert "torch.mm(" in compiled.source


@pytest.mark.parametrize("a_shape, b_shape, fn", [
    ((17, 40), (32, 40), lambda x, w: x @ w.T),  # B column-major
    ((40, 16), (40, 32), lambda xt, w: xt.T @ w),  # A column-major
    ((40, 16), (32, 40), lambda xt, wt: xt.T @ wt.T),  # both
], ids=["b", "a", "both"])
def test_transposed_operands_are_read_as_stored(cublas, a_shape, b_shape, fn):
    x, w = torch.randn(a_shape, dtype=torch.float16), torch.randn(b_shape, dtype=torch.float16)
    compiled = _check(fn, [x, w], kernels=0, calls=["mm"])
    assert "contiguous" not in compiled.source and "clone" not in compiled.source


def test_batched_product_is_bmm(cublas):
    q, k = torch.randn(2, 3, 17, 16), torch.randn(2, 3, 20, 16)
    _check(lambda q, k: q @ k.transpose(-1, -2), [q, k], kernels=0, calls=["bmm"])


def test_product_under_a_reshape_writes_its_buffer_through_a_view(cublas):
    """x [2, 8, 16] @ w^T: the plan's product is [16, 16] @ [16, 24], reshaped to [2, 8, 24]."""
    x, w = torch.randn(2, 8, 16), torch.randn(24, 16)
    compiled = _check(lambda x, w: x @ w.T, [x, w], kernels=0, calls=["mm"])
    assert compiled.library_calls[0].out.shape == (16, 24)


def test_product_under_a_permute_writes_its_buffer_transposed():
    """A kernel storing (a @ b)^T contiguous: cuBLAS writes the product column-major."""
    from eqfuse.schema.plan import Buffer, KernelSpec, PNode
    a = PNode("load", ("a", (20, 1), 0), (), (16, 20), "float32")
    b = PNode("load", ("b", (8, 1), 0), (), (20, 8), "float32")
    dot = PNode("dot", (), (a, b), (16, 8), "float32")
    root = PNode("permute", ((1, 0),), (dot,), (8, 16), "float32")
    buffers = {"out": Buffer("out", (8, 16), "float32", "temp")}
    call = library.library_call(KernelSpec("k0", [(root, "out")]), buffers)
    assert call.op == "mm" and [v.buf for v in call.operands] == ["a", "b"]
    assert (call.out.buf, call.out.shape, call.out.strides) == ("out", (16, 8), (1, 16))


def test_kernels_read_what_the_call_wrote(cublas):
    """A product whose output a reduction reads (a matmul kernel holds no reduction): the
    call writes the buffer, the reduction kernel reads it, the buffer is let go of after."""
    a, b = torch.randn(33, 20), torch.randn(20, 12)
    compiled = _check(lambda a, b: (a @ b).softmax(-1), [a, b], kernels=1, calls=["mm"])
    body = compiled.source.split("def call_boxed")[1]
    assert body.index("torch.mm(") < body.index("_launch(")


def test_product_with_an_epilogue_stays_a_kernel(cublas):
    x, w, bias = torch.randn(17, 40), torch.randn(40, 33), torch.randn(33)
    _check(lambda x, w, bias: torch.relu(x @ w + bias), [x, w, bias], kernels=1, calls=[])


def test_product_with_a_prologue_stays_a_kernel(cublas):
    x, w = torch.randn(17, 40, dtype=torch.float16), torch.randn(40, 33)
    _check(lambda x, w: x @ w.half(), [x, w], kernels=1, calls=[])


def test_a_layout_cublas_would_copy_stays_a_kernel(cublas):
    """Every other column of x: no unit stride along either dim of the matrix."""
    x, w = torch.randn(17, 80), torch.randn(40, 32)
    _check(lambda x, w: x[:, ::2] @ w, [x, w], kernels=1, calls=[])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rows_not_16_byte_aligned_stay_a_kernel(cublas, dtype):
    """GPT-2's LM head: logits' rows 50257 apart. cuBLAS takes such rows only with kernels
    that load one element at a time (7.6x slower on an H200), so the product is generated.
    Rows of 36 bytes (18 halves, 9 floats) are not a multiple of 16; 32 halves (64 bytes) are."""
    x, w = torch.randn(17, 32, dtype=dtype), torch.randn(9 if dtype == torch.float32 else 18, 32, dtype=dtype)
    _check(lambda x, w: x @ w.T, [x, w], kernels=1, calls=[])
    odd_k = torch.randn(17, 18, dtype=dtype)  # the operand's rows unaligned
    _check(lambda x, w: x @ w, [odd_k, torch.randn(18, 32, dtype=dtype)], kernels=1, calls=[])
    _check(lambda x, w: x @ w.T, [x, torch.randn(32, 32, dtype=dtype)], kernels=0, calls=["mm"])


@pytest.mark.parametrize("how", ["option", "env"])
def test_switched_off_the_product_is_generated(cublas, monkeypatch, how):
    a, b = torch.randn(17, 20), torch.randn(20, 9)
    options = {}
    if how == "env":
        monkeypatch.setenv(library.ENV, "0")
    else:
        options["cublas"] = False
    compiled = eqfuse.compile(torch.matmul, [a, b], **options)
    assert len(compiled.kernels) == 1 and compiled.library_calls == []
    assert_matches(compiled(a, b), a @ b, contraction=True)


def _mm_softmax(x, w):
    return (x @ w).softmax(-1)


def test_a_sized_module_calls_cublas_at_every_size(cublas, monkeypatch):
    """A graph with a dynamic row count: the sized module's call views the buffers with
    their rows written over SIZE, as its allocations are (codegen/sized.py)."""
    import eqfuse.backend
    import eqfuse.runtime.sized_graph as sized_graph

    made = []
    build = sized_graph.build
    monkeypatch.setattr(sized_graph, "build", lambda *a, **k: made.append(build(*a, **k)) or made[-1])
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    w = torch.randn(16, 24)
    g = torch.compile(_mm_softmax, backend="eqfuse", dynamic=True)
    for n in (5, 7, 9, 33, 2):
        x = torch.randn(n, 16)
        assert_matches(g(x, w), _mm_softmax(x, w), contraction=True)
    (first,) = eqfuse.backend.history
    assert [c.op for c in first.library_calls] == ["mm"] and len(first.kernels) == 1
    (graph,) = made
    assert len(graph.sized.infos) == 1
    call = next(line for line in graph.sized.source.splitlines() if "torch.mm(" in line)
    assert "SIZE" in call, call


def test_wanted_on_the_gpu_unless_turned_off(monkeypatch):
    monkeypatch.delenv(library.ENV, raising=False)
    assert library.wanted("cuda") and not library.wanted("cuda", option=False) and not library.wanted("cpu")
    monkeypatch.setenv(library.ENV, "off")
    assert not library.wanted("cuda")
    monkeypatch.delenv(library.ENV)
    monkeypatch.setattr(library, "FORCE", True)
    assert library.wanted("cpu")


def test_plan_cache_key_holds_the_switch(monkeypatch):
    from eqfuse.runtime import plan_cache
    monkeypatch.delenv(library.ENV, raising=False)
    on = plan_cache._device_parts(torch.device("cpu"))
    monkeypatch.setattr(library, "FORCE", True)
    assert plan_cache._device_parts(torch.device("cpu")) != on


def test_a_plan_cache_hit_keeps_the_calls(cublas, tmp_path, monkeypatch):
    from eqfuse.runtime import plan_cache
    monkeypatch.setenv("EQFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(plan_cache.ENV_SWITCH, "1")
    a, b = torch.randn(33, 20), torch.randn(20, 12)
    first = eqfuse.compile(_mm_softmax, [a, b])
    again = eqfuse.compile(_mm_softmax, [a, b])
    assert not first.report["plan_cache"]["hit"] and again.report["plan_cache"]["hit"]
    assert [c.op for c in again.library_calls] == ["mm"] and again.source == first.source
    assert_matches(again(a, b), _mm_softmax(a, b), contraction=True)


def test_export_refuses_library_calls(cublas, tmp_path):
    from eqfuse.export import ExportError, export_graph
    a, b = torch.randn(17, 20), torch.randn(20, 8)
    with pytest.raises(ExportError, match="cannot export cuBLAS calls .*cublas=False"):
        export_graph(eqfuse.compile(torch.matmul, [a, b]), tmp_path)


def test_inspect_lists_the_calls(cublas, tmp_path):
    a, b = torch.randn(33, 20), torch.randn(20, 12)
    result = eqfuse.compile(lambda a, b: (a @ b).softmax(-1), [a, b]).inspect(tmp_path, arch="sm_90")
    assert len(result.kernels) == 1 and result.library_calls == ["k0_mm: torch.mm, [33 x 20] @ [20 x 12] float32"]
    assert "cuBLAS call k0_mm: torch.mm" in str(result)


@pytest.mark.parametrize("layout, ok", [
    (((4, 5), (5, 1)), True),  # row-major
    (((4, 5), (1, 4)), True),  # column-major
    (((4, 5), (8, 1)), True),  # rows padded
    (((4, 5), (3, 1)), False),  # rows overlap
    (((4, 5), (10, 2)), False),  # no unit stride
    (((4, 1), (1, 1)), True),  # one column: both at once
])
def test_blas_layout(layout, ok):
    assert library.blas_layout(*layout) is ok


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_on_the_gpu_a_plain_product_is_cublas(monkeypatch, dtype):
    monkeypatch.delenv(library.ENV, raising=False)
    a, b = torch.randn(257, 104, dtype=dtype, device="cuda"), torch.randn(104, 136, dtype=dtype, device="cuda")
    _check(torch.matmul, [a, b], kernels=0, calls=["mm"])
    compiled = _check(lambda a, b: (a @ b).softmax(-1), [a, b], kernels=1, calls=["mm"])
    for _ in range(3):  # recorded into a CUDA graph, then replayed
        assert_matches(compiled(a, b), (a @ b).softmax(-1), contraction=True)
    assert DEVICE == "cuda"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_odd_rows_are_padded_for_the_products(cublas, dtype):
    """A cross-entropy's gradient shape: a softmax over 1030 columns read by two products
    (as the gradient of GPT-2's logits is, for its input and for the weight). The
    intermediate's rows (1030 elements, not a multiple of 16 bytes) are padded to 128
    bytes, so that both products are library calls on aligned operands."""
    x, w, h = (torch.randn(24, 1030, dtype=dtype), torch.randn(1030, 40, dtype=dtype),
               torch.randn(24, 40, dtype=dtype))

    def fn(x, w, h):
        g = (torch.softmax(x.float(), -1) - 0.5).to(dtype)
        return g @ w, g.T @ h

    compiled = eqfuse.compile(fn, [x, w, h])
    for got, expected in zip(compiled(x, w, h), fn(x, w, h)):
        assert_matches(got, expected, contraction=True)
    padded = {b.name: b.strides for b in compiled.plan.buffers.values() if b.strides is not None}
    row = 1056 if dtype == torch.float32 else 1088
    assert list(padded.values()) == [(row, 1)], compiled.explain()
    # g @ w runs along g's rows (K = 1030, unit stride), g^T @ h along its columns (M = 1030):
    # both cuBLAS on the padded rows, each with its odd dim split off
    main = 1028 if dtype == torch.float32 else 1024
    assert [c.description for c in compiled.library_calls] == [
        f"[24 x 1030] @ [1030 x 40] {str(dtype)[6:]}, K split {main} + {1030 - main}",
        f"[1030 x 24] @ [24 x 40] {str(dtype)[6:]}, M split {main} + {1030 - main}"], compiled.explain()
    assert all(c.operands[0].buf in padded and row in c.operands[0].strides for c in compiled.library_calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_returned_product_with_long_odd_rows_is_returned_padded(cublas, dtype):
    """GPT-2's LM head: the logits (rows of 1030 here) are the graph's output. Returned
    with padded rows, as torch.compile returns them, the product is a library call with
    its odd N split off; the values are eager's."""
    x, w = torch.randn(24, 40, dtype=dtype), torch.randn(1030, 40, dtype=dtype)
    compiled = eqfuse.compile(lambda x, w: x @ w.T, [x, w])
    got = compiled(x, w)
    assert_matches(got, x @ w.T, contraction=True)
    row = 1056 if dtype == torch.float32 else 1088
    assert got.stride() == (row, 1)
    main = 1028 if dtype == torch.float32 else 1024
    assert [c.description for c in compiled.library_calls] == [
        f"[24 x 40] @ [40 x 1030] {str(dtype)[6:]}, N split {main} + {1030 - main}"], compiled.explain()


def test_outputs_keep_eager_rows_where_asked_and_in_training_graphs(cublas):
    """``pad_outputs=False`` keeps eager's strides, and so do the backend's training graphs
    (a forward's outputs include what its backward saved, traced with eager's strides)."""
    x, w = torch.randn(24, 40), torch.randn(1030, 40)
    compiled = eqfuse.compile(lambda x, w: x @ w.T, [x, w], pad_outputs=False)
    assert compiled(x, w).stride() == (1030, 1) and compiled.library_calls == []
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w: (x @ w.T) * 1, backend="eqfuse", options={"autotune": False})
    wg = w.clone().requires_grad_()
    out = fn(x, wg)
    assert out.stride() == (1030, 1)
    out.sum().backward()
    torch.testing.assert_close(wg.grad, x.sum(0).expand(1030, 40).contiguous())
    with torch.no_grad():  # inference: the compiled graph's output is returned padded
        torch._dynamo.reset()
        assert fn(x, w).stride() == (1056, 1)


def test_a_product_also_returned_as_a_view_keeps_eager_rows(cublas):
    """An output that is a view of another keeps its strides: its rows stay as eager's,
    and the product a generated kernel."""
    x, w = torch.randn(24, 40), torch.randn(1030, 40)

    def fn(x, w):
        y = x @ w.T
        return y, y[:, :4]

    compiled = eqfuse.compile(fn, [x, w])
    for got, expected in zip(compiled(x, w), fn(x, w)):
        assert_matches(got, expected, contraction=True)
        assert got.stride() == expected.stride()
    assert compiled.library_calls == [], compiled.explain()


def test_padding_leaves_short_aligned_and_shared_rows():
    from eqfuse.codegen.padding import padded_strides
    assert padded_strides((24, 1030), 4) == (1056, 1)
    assert padded_strides((2, 3, 50257), 2) == (3 * 50304, 50304, 1)
    assert padded_strides((24, 1032), 2) is None  # 2064 bytes: a multiple of 16
    assert padded_strides((24, 1000), 2) is None  # short rows
    assert padded_strides((1030,), 4) is None  # one row


@pytest.mark.parametrize("epilogue", [False, True])
def test_an_input_with_long_odd_rows_is_copied_once_for_its_products(cublas, monkeypatch, epilogue):
    """The gradient of GPT-2's logits reaches the backward's graph as an input with rows
    50257 apart: it is copied once into padded rows, and both products read the copy (as
    library calls where nothing is fused around them)."""
    from eqfuse.codegen import padding
    monkeypatch.setattr(padding, "MIN_COPIED", 1)
    g, w, h = torch.randn(24, 1030), torch.randn(1030, 40), torch.randn(24, 40)

    def fn(g, w, h):
        dx, dw = g @ w, g.T @ h
        return (dx + h, dw * 2.0) if epilogue else (dx, dw)

    compiled = eqfuse.compile(fn, [g, w, h])
    for got, expected in zip(compiled(g, w, h), fn(g, w, h)):
        assert_matches(got, expected, contraction=True)
    copies = [k for k in compiled.plan.kernels if padding.COPY_SUFFIX in k.name]
    assert len(copies) == 1, compiled.explain()
    (_, copy), = copies[0].roots
    assert compiled.plan.buffers[copy].strides == (1056, 1)
    products = [s for s in compiled.plan.steps if s is not copies[0]]
    readers = [s for s in products if copy in step_reads(s)]
    assert len(readers) == 2, compiled.explain()
    calls = [c.description for c in compiled.library_calls]
    # g @ w (+ h) runs along g's rows (K = 1030, split); g^T @ h * 2 is no plain product
    assert calls == (["[24 x 1030] @ [1030 x 40] + a matrix float32, K split 1028 + 2"] if epilogue else
                     ["[24 x 1030] @ [1030 x 40] float32, K split 1028 + 2",
                      "[1030 x 24] @ [24 x 40] float32, M split 1028 + 2"]), compiled.explain()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_matrix_added_to_a_product_is_cublas_epilogue(cublas, dtype):
    """A residual (or a tied weight's other gradient) added to a product: ``torch.addmm``
    (``baddbmm`` over a batch), the sum rounded once; a bias broadcast over the rows stays
    a generated kernel's epilogue."""
    g, w, h = torch.randn(64, 256, dtype=dtype), torch.randn(256, 48, dtype=dtype), torch.randn(64, 48, dtype=dtype)
    compiled = _check(lambda g, w, h: g @ w + h, [g, w, h], kernels=0, calls=["addmm"])
    assert "+ a matrix" in compiled.library_calls[0].description
    _check(lambda g, w, h: h + g @ w, [g, w, h], kernels=0, calls=["addmm"])
    _check(lambda g, w, h: g @ w + h[0], [g, w, h], kernels=1, calls=[])
    a, b, c = (torch.randn(shape, dtype=dtype) for shape in ((3, 32, 64), (3, 64, 16), (3, 32, 16)))
    _check(lambda a, b, c: torch.bmm(a, b) + c, [a, b, c], kernels=0, calls=["baddbmm"])


def test_odd_dims_are_those_run_along_with_unit_stride():
    from eqfuse.codegen.library import odd_dims
    from eqfuse.schema.values import BufRef

    def refs(*layouts):
        return [BufRef("x", shape, strides, 0) for shape, strides in layouts]
    a, b, out = ((4096, 50257), (50304, 1)), ((50257, 768), (768, 1)), ((4096, 768), (768, 1))
    assert odd_dims(refs(a, b, out), 2) == {"k": 50257}  # A along K
    at = ((50257, 4096), (1, 50304))
    assert odd_dims(refs(at, ((4096, 768), (768, 1)), ((50257, 768), (768, 1))), 2) == {"m": 50257}
    assert odd_dims(refs(((8, 768), (768, 1)), ((768, 50257), (1, 768)), ((8, 50257), (50264, 1))), 2) == {"n": 50257}
    added_column_major = ((4096, 768), (1, 4096))
    assert odd_dims(refs(a, b, added_column_major, out), 2) == {"k": 50257}
    assert odd_dims(refs(((100, 1), (1, 1)), ((1, 8), (8, 1)), ((100, 8), (8, 1))), 4) == {}  # an outer product
    assert odd_dims(refs(((8, 1032), (1032, 1)), ((1032, 768), (768, 1)), out), 2) == {}


@pytest.mark.parametrize("batched", [False, True])
def test_odd_dims_split_keep_values_and_special_values(cublas, monkeypatch, batched):
    """Products whose odd K, M or N runs along a unit stride are split into an aligned part
    and a tail (K: the tail's product first, the main one added onto it): every element
    as one product gives it, NaN, infinities and signed zeros where they fall in the main
    part or the tail."""
    from eqfuse.codegen import padding
    monkeypatch.setattr(library, "MIN_SPLIT", 8)
    monkeypatch.setattr(padding, "MIN_ROW", 8)  # the product's output [13 x 13] gets padded rows
    lead = (2,) if batched else ()

    def odd(rows, cols):  # a matrix of odd width, its rows 16 floats apart
        x = torch.randn(*lead, rows, 16)[..., :cols]
        x[..., 0, cols - 1], x[..., 1, 3], x[..., 2, cols - 1], x[..., 3, 0] = (float("nan"), float("inf"),
                                                                              float("-inf"), -0.0)
        return x
    g, w = odd(13, 13), torch.randn(*lead, 13, 8)
    w[..., 12, 4] = float("inf")
    cases = {"k": (lambda g, w: g @ w, [g, w]),  # A along K
             "m": (lambda g, w: g.transpose(-1, -2) @ w, [g, w]),  # A along M
             "n": (lambda w, g: (w.transpose(-1, -2) @ g).softmax(-1), [w, g])}  # B and the output along N
    for dim, (fn, inputs) in cases.items():
        compiled = eqfuse.compile(fn, inputs)
        assert_matches(compiled(*inputs), fn(*inputs), contraction=True)
        call, = compiled.library_calls
        assert f"{dim.upper()} split 12 + 1" in call.description, compiled.explain()
    h = torch.randn(*lead, 13, 8)
    compiled = eqfuse.compile(lambda g, w, h: g @ w + h, [g, w, h])
    assert_matches(compiled(g, w, h), g @ w + h, contraction=True)
    assert [c.op for c in compiled.library_calls] == ["baddbmm" if batched else "addmm"], compiled.explain()
    assert f"{'baddbmm' if batched else 'addmm'}_(" in compiled.source


def test_an_operand_sliced_from_longer_rows_is_copied_contiguous(cublas, monkeypatch):
    """Rows of 1024 floats (a whole number of 16 bytes) read 1030 apart, a slice of a wider
    input: the copy needs no padding, only its own contiguous rows."""
    from eqfuse.codegen import padding
    monkeypatch.setattr(padding, "MIN_COPIED", 1)
    wide, w = torch.randn(24, 1030), torch.randn(1024, 40)
    g = wide[:, :1024]
    compiled = eqfuse.compile(lambda g, w: g @ w, [g, w])
    assert_matches(compiled(g, w), g @ w, contraction=True)
    copy, = [k for k in compiled.plan.kernels if padding.COPY_SUFFIX in k.name]
    (_, buf), = copy.roots
    assert compiled.plan.buffers[buf].layout == (1024, 1)
    assert [c.operands[0].buf for c in compiled.library_calls] == [buf]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sum_of_products_is_a_call_then_each_added(cublas, dtype):
    """A sum of products that extraction keeps in one kernel (a training step's gradient
    of an input that two projections read): ``torch.mm``, then each further product added
    onto the output (``addmm_``), on ordinary and special values."""
    torch.manual_seed(0)
    a, b = torch.randn(512, 1024, dtype=dtype), torch.randn(512, 1024, dtype=dtype)
    w1, w2 = torch.randn(1024, 256, dtype=dtype), torch.randn(1024, 256, dtype=dtype)
    a[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, torch.finfo(dtype).max])
    compiled = _check(lambda a, b, w1, w2: a @ w1 + b @ w2, [a, b, w1, w2], kernels=0, calls=["mm"])
    assert _calls(compiled)[0][1] == f"[512 x 1024] @ [1024 x 256] + [512 x 1024] @ [1024 x 256] {str(dtype)[6:]}"
    assert ".addmm_(" in compiled.source


def test_a_sum_of_products_with_a_matrix_added_is_addmm_then_the_rest():
    """(a @ w1 + b @ w2) + h, one kernel's tree of adds: addmm, then the other product
    added; with an odd K the sum stays a generated kernel."""
    from eqfuse.schema.plan import Buffer, KernelSpec, PNode, contiguous_strides

    def load(name, shape):
        return PNode("load", (name, contiguous_strides(shape), 0), (), shape, "float16")

    def root(k):
        dots = [PNode("dot", (), (load(x, (64, k)), load(w, (k, 32))), (64, 32), "float16")
                for x, w in (("a", "w1"), ("b", "w2"))]
        total = PNode("binary", ("add",), tuple(dots), (64, 32), "float16")
        return PNode("binary", ("add",), (total, load("h", (64, 32))), (64, 32), "float16")
    buffers = {"out": Buffer("out", (64, 32), "float16", "temp")}
    call = library.library_call(KernelSpec("k0", [(root(2048), "out")]), buffers)
    assert call.op == "addmm" and [v.buf for v in call.operands] == ["a", "w1", "h"]
    assert [(op, [v.buf for v in operands], accumulate) for op, operands, _, accumulate in library.torch_calls(call)] \
        == [("addmm", ["a", "w1", "h"], False), ("addmm", ["b", "w2"], True)]
    assert step_reads(call) == {"a", "w1", "h", "b", "w2"}
    assert library.library_call(KernelSpec("k0", [(root(2047), "out")]), buffers) is None


def _gated_mlp(x, w_gate, w_up, w_down, residual):
    return (torch.nn.functional.silu(x @ w_gate) * (x @ w_up)) @ w_down + residual


@pytest.mark.parametrize("tokens, plain", [(4096, True), (16, False)], ids=["compute-bound", "launch-bound"])
def test_extraction_weighs_cublas_on_plain_products(tokens, plain):
    """Where cuBLAS will run the plain products, extraction weighs its speed: at a Mistral
    MLP's widths and 4096 tokens (compute-bound: cuBLAS ran 790 TFLOP/s on an H200 where
    the generated products with an activation fused ran 560-680) the two products stay
    plain and the activation is a kernel of its own; at 16 tokens the fused product, which
    saves a launch and a round trip, wins as before. Plans only, on meta tensors."""
    from eqfuse.frontend.capture import capture
    from eqfuse.pipeline import _extract
    from eqfuse.runtime.compiled import Options

    hidden, inner = 4096, 14336
    shapes = [(tokens, hidden), (hidden, inner), (hidden, inner), (inner, hidden), (tokens, hidden)]
    captured = capture(_gated_mlp, [torch.empty(s, dtype=torch.bfloat16, device="meta") for s in shapes])
    counts = {}
    for weighed in (False, True):
        plan, _, _ = _extract(captured, Options.make(), {}, library=weighed)
        library.library_products(plan)
        counts[weighed] = len(plan.library_calls)
    # the gate's and up's products, the down projection with the residual added (addmm)
    assert counts[True] == (3 if plain else 1) and counts[False] == (2 if plain else 1), counts


def _float32_scores(q, k):
    return (q.float() * 0.125) @ k.float().transpose(-1, -2)


def test_float32_products_go_to_cublas_where_its_sgemm_wins():
    """IEEE float32 products (no TF32) run about 5-7 TFLOP/s generated and twice that in
    cuBLAS's SGEMM (ViT's float32 attention products on an H200): where cuBLAS will run
    plain products, extraction stores the widened, scaled operand and hands cuBLAS the
    product; without cuBLAS the cast and the scale stay the product's prologue. Plans only,
    on meta tensors."""
    from eqfuse.frontend.capture import capture
    from eqfuse.pipeline import _extract
    from eqfuse.runtime.compiled import Options

    shapes = [(384, 256, 64), (384, 256, 64)]  # (197 rows of float32 are not 16-byte aligned: no cuBLAS call)
    captured = capture(_float32_scores, [torch.empty(s, dtype=torch.bfloat16, device="meta") for s in shapes])
    found = {}
    for weighed in (False, True):
        plan, _, _ = _extract(captured, Options.make(), {}, library=weighed)
        library.library_products(plan)
        found[weighed] = (len(plan.library_calls), len(plan.kernels))
    assert found == {False: (0, 1), True: (1, 2)}, found
