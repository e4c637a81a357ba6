"""K-major copies of TF32 right operands (eqfuse/codegen/kmajor.py): a float32 product under
``allow_tf32`` whose right operand is N-major runs as a transposing copy of that operand
(``<kernel>_kmajor``) and the product reading the copy K-major.

Small shapes are copied only where a test sets ``FORCE``; the model's own choice is checked
on plan kernels built by hand at full size, without running them. The interpreter computes
TF32 products in float32, so results match eager tightly; on a GPU eqfuse's TF32 products
and cuBLAS's keep 10 bits of each operand's mantissa, as float16 does, and are compared
within float16's tolerance."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, assert_matches

import eqfuse
from eqfuse.codegen import indexing, kmajor, schedules, splitk
from eqfuse.codegen.indexing import strided_offset
from eqfuse.schema.plan import Buffer, KernelSpec, Plan, PNode, contiguous_strides

TF32_TOLERANCE = torch.float16 if DEVICE == "cuda" else None


@pytest.fixture
def tf32():
    """``allow_tf32`` on for the test, restored after it."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture
def force(monkeypatch, tf32):
    """Every operand that qualifies is copied, whatever the sizes and the model say."""
    monkeypatch.setattr(kmajor, "FORCE", True)
    monkeypatch.delenv(kmajor.ENV, raising=False)


def _launches(compiled) -> list[str]:
    body = compiled.source.split("\ndef call(")[1]
    return [line.strip().split("_launch(")[0] for line in body.splitlines() if "_launch(" in line]


def _reads_kmajor(compiled, product) -> list[str]:
    """The copies' buffers the product reads, each checked to be read K-major: its address
    steps by one along K and not along N (the load of the product's B tile)."""
    sched = product.schedule
    point = {"bindex": 0, "kindex_b": sched.k // 2, "nindex": sched.n // 2}
    found = []
    for d in (n for n in product.spec.walk() if n.op == "dot"):
        b = d.args[1]
        assert b.op == "permute" and b.args[0].op == "load", b
        load = b.args[0]
        buf, strides, offset = load.attrs
        assert compiled.plan.buffers[buf].shape == load.shape and strides == contiguous_strides(load.shape)
        env = indexing.operand_env(b, schedules.matmul_envs(sched)[2])
        expr = strided_offset(env, strides, load.shape, offset).expr

        def at(**moved):
            return eval(expr, {}, {**point, **moved})  # noqa: S307 - the kernel's own index arithmetic
        assert at(kindex_b=point["kindex_b"] + 1) - at() == 1
        assert at(nindex=point["nindex"] + 1) - at() == sched.k
        found.append(buf)
    return found


def _copied(compiled, copies: int = 1):
    """(copy kernels, product) of a graph compiled to one product with K-major copies."""
    *firsts, product = compiled.kernels
    assert len(firsts) == copies
    assert [k.name for k in firsts] == [product.name + kmajor.SUFFIX + (str(i) if i else "") for i in range(copies)]
    assert _launches(compiled) == [k.name for k in compiled.kernels]
    assert all(k.schedule.kind == "pointwise" for k in firsts)
    assert product.schedule.kind == "matmul" and 'input_precision="tf32"' in product.source
    bufs = _reads_kmajor(compiled, product)
    assert sorted(set(bufs)) == sorted(b for k in firsts for _, b in k.spec.roots)
    return firsts, product


def _mm(a, b):
    return a @ b


@pytest.mark.parametrize("m, k, n", [(100, 33, 257), (64, 257, 100), (1, 40, 17)])
def test_product_reads_a_k_major_copy(force, m, k, n):
    torch.manual_seed(0)
    a, b = torch.randn(m, k), torch.randn(k, n)
    compiled = eqfuse.compile(_mm, [a, b])
    assert_matches(compiled(a, b), a @ b, contraction=True, dtype=TF32_TOLERANCE)
    (copy,), product = _copied(compiled)
    # The copy reads B as given and writes [N, K]
    (root, buf), = copy.spec.roots
    assert root.shape == (n, k) and compiled.plan.buffers[buf].shape == (n, k)
    assert "in1" in copy.params and "in1" not in product.params


def _weight_grad_gelu(x, dy, bias):
    return F.gelu(x.t() @ dy + bias)


def test_transposed_left_operand_and_epilogue(force):
    """A read transposed (x.t()), bias and gelu after the product: only B is copied, the
    epilogue stays in the product's kernel."""
    torch.manual_seed(0)
    x, dy, bias = torch.randn(301, 45), torch.randn(301, 70), torch.randn(70)
    compiled = eqfuse.compile(_weight_grad_gelu, [x, dy, bias])
    assert_matches(compiled(x, dy, bias), _weight_grad_gelu(x, dy, bias), contraction=True,
                   dtype=TF32_TOLERANCE)
    (copy,), product = _copied(compiled)
    assert "in1" in copy.params and {"in0", "in2"} <= set(product.params) and "tl.erf" in product.source


def test_batched_product_copies_each_matrix(force):
    torch.manual_seed(0)
    a, b = torch.randn(3, 40, 50), torch.randn(3, 50, 70)
    compiled = eqfuse.compile(torch.bmm, [a, b])
    assert_matches(compiled(a, b), torch.bmm(a, b), contraction=True, dtype=TF32_TOLERANCE)
    (copy,), product = _copied(compiled)
    assert product.schedule.batch == (3,)
    assert compiled.plan.buffers[copy.spec.roots[0][1]].shape == (3, 70, 50)


def test_paired_products_copy_both_right_operands(force):
    """SwiGLU's pair, one K loop: both weights are copied, the loop reads both K-major."""
    torch.manual_seed(0)
    x, w1, w3 = torch.randn(20, 48), torch.randn(48, 36), torch.randn(48, 36)

    def paired(p, u, v):
        return F.silu(p @ u) * (p @ v)
    compiled = eqfuse.compile(paired, [x, w1, w3])
    assert_matches(compiled(x, w1, w3), paired(x, w1, w3), contraction=True, dtype=TF32_TOLERANCE)
    _copied(compiled, copies=2)


def test_split_k_chunks_the_copy(force, monkeypatch):
    """Split-K runs after: its stage 1 reads chunks of the K-major copy."""
    monkeypatch.setattr(splitk, "FORCE_CHUNKS", 3)
    monkeypatch.delenv(splitk.ENV, raising=False)
    torch.manual_seed(0)
    a, b = torch.randn(17, 600), torch.randn(600, 40)
    compiled = eqfuse.compile(_mm, [a, b])
    assert_matches(compiled(a, b), a @ b, contraction=True, dtype=TF32_TOLERANCE)
    names = [k.name for k in compiled.kernels]
    assert len(names) == 3 and names[0].endswith(kmajor.SUFFIX) and names[1].endswith(splitk.STAGE1_SUFFIX)
    assert compiled.kernels[1].schedule.batch == (3,)


# --- where it does not apply ----------------------------------------------------------------------

def _one_kernel(fn, inputs):
    compiled = eqfuse.compile(fn, inputs)
    tf32 = torch.backends.cuda.matmul.allow_tf32 and inputs[0].dtype == torch.float32
    assert_matches(compiled(*inputs), fn(*inputs), contraction=True, dtype=TF32_TOLERANCE if tf32 else None)
    assert len(compiled.kernels) == 1 and compiled.kernels[0].schedule.kind == "matmul"
    assert not any(b.startswith("buf_") and kmajor.SUFFIX in b for b in compiled.plan.buffers)
    return compiled.kernels[0]


def test_not_without_tf32(force):
    torch.backends.cuda.matmul.allow_tf32 = False  # the fixture restores it
    a, b = torch.randn(100, 33), torch.randn(33, 257)
    assert 'input_precision="ieee"' in _one_kernel(_mm, [a, b]).source


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_not_for_half_precision(force, dtype):
    a, b = torch.randn(100, 33, dtype=dtype), torch.randn(33, 257, dtype=dtype)
    _one_kernel(_mm, [a, b])


def test_not_for_a_k_major_operand(force):
    """x @ w.t() with w [N, K]: B is read K-major as stored."""
    x, w = torch.randn(100, 33), torch.randn(257, 33)
    _one_kernel(lambda p, q: p @ q.t(), [x, w])


def test_not_for_a_single_row_of_k(force):
    """K = 1: B [1, N] is K-major and N-major at once."""
    a, b = torch.randn(33, 1), torch.randn(1, 50)
    _one_kernel(_mm, [a, b])


def test_not_for_a_broadcast_operand(force):
    """A matrix shared by a batch (read with a stride of 0) is not copied once per matrix."""
    def shared(a, w):
        return torch.bmm(a, w[:1].expand(3, 50, 70))
    a, w = torch.randn(3, 40, 50), torch.randn(3, 50, 70)
    assert _one_kernel(shared, [a, w]).schedule.batch == (3,)


def test_not_below_the_threshold(tf32, monkeypatch):
    monkeypatch.delenv(kmajor.ENV, raising=False)
    a, b = torch.randn(100, 33), torch.randn(33, 257)
    _one_kernel(_mm, [a, b])


def test_switch_off_keeps_one_kernel(force, monkeypatch):
    monkeypatch.setenv(kmajor.ENV, "0")
    a, b = torch.randn(100, 33), torch.randn(33, 257)
    _one_kernel(_mm, [a, b])


# --- the model's choice, on plan kernels built by hand (no kernel is run) ------------------------

def _mm_spec(m, n, k, dtype="float32"):
    """``a @ b`` with both row-major: B is N-major."""
    a = PNode("load", ("a", (k, 1), 0), (), (m, k), dtype)
    b = PNode("load", ("b", (n, 1), 0), (), (k, n), dtype)
    product = PNode("dot", (), (a, b), (m, n), dtype)
    buffers = {"a": Buffer("a", (m, k), dtype, "input"), "b": Buffer("b", (k, n), dtype, "input"),
               "out": Buffer("out", (m, n), dtype, "output")}
    return KernelSpec("k0_mm", [(product, "out")], ["mm"]), buffers


def test_model_copies_the_2048_cube(tf32, monkeypatch):
    monkeypatch.delenv(kmajor.ENV, raising=False)
    spec, buffers = _mm_spec(2048, 2048, 2048)
    (copy,), product, (buf,) = kmajor.kmajor_kernel(spec, buffers)
    assert copy.name == "k0_mm_kmajor" and buf.shape == (2048, 2048) and buf.dtype == "float32"
    assert not kmajor.n_major(next(n for n in product.walk() if n.op == "dot").args[1], schedules.schedule_of(product))


@pytest.mark.parametrize("m, n, k", [
    (128, 2048, 2048),  # few rows: below MIN_M
    (2048, 256, 512),  # a small operand: below MIN_ELEMENTS
    (256, 2048, 2048),  # modelled: the copy (about 22 us) costs more than the slow product loses
])
def test_model_leaves_small_products(tf32, m, n, k):
    spec, buffers = _mm_spec(m, n, k)
    assert kmajor.kmajor_kernel(spec, buffers) is None


def test_model_leaves_fp16_and_ieee_products(tf32):
    spec, buffers = _mm_spec(2048, 2048, 2048, "float16")
    assert kmajor.kmajor_kernel(spec, buffers) is None
    torch.backends.cuda.matmul.allow_tf32 = False
    spec, buffers = _mm_spec(2048, 2048, 2048)
    assert kmajor.kmajor_kernel(spec, buffers) is None


def test_rewriting_a_plan_twice_changes_nothing(tf32):
    spec, buffers = _mm_spec(2048, 2048, 2048)
    plan = Plan([buffers["a"], buffers["b"]], dict(buffers), [spec], [("buffer", "out")])
    kmajor.kmajor_operands(plan)
    once = [(k.name, [b for _, b in k.roots]) for k in plan.kernels]
    assert len(once) == 2 and set(plan.buffers) == set(buffers) | {"buf_k0_mm_kmajor"}
    kmajor.kmajor_operands(plan)
    assert [(k.name, [b for _, b in k.roots]) for k in plan.kernels] == once


def test_plan_cache_key_holds_the_switch_and_tf32(monkeypatch, tf32):
    from eqfuse.runtime import plan_cache
    monkeypatch.delenv(kmajor.ENV, raising=False)
    on = plan_cache._device_parts(torch.device("cpu"))
    monkeypatch.setenv(kmajor.ENV, "0")
    assert plan_cache._device_parts(torch.device("cpu")) != on
    monkeypatch.delenv(kmajor.ENV)
    torch.backends.cuda.matmul.allow_tf32 = False
    assert plan_cache._device_parts(torch.device("cpu")) != on


def test_a_plan_built_without_tf32_is_not_reused_with_it(force, tmp_path, monkeypatch):
    """Compiled with allow_tf32 off, then on, with the plan cache on: the second compile
    misses and copies the operand; back off, the first plan is found again."""
    from eqfuse.runtime import plan_cache
    monkeypatch.setenv("EQFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(plan_cache.ENV_SWITCH, "1")
    a, b = torch.randn(100, 33), torch.randn(33, 257)
    torch.backends.cuda.matmul.allow_tf32 = False
    off = eqfuse.compile(_mm, [a, b])
    assert len(off.kernels) == 1 and not off.report["plan_cache"]["hit"]
    torch.backends.cuda.matmul.allow_tf32 = True
    on = eqfuse.compile(_mm, [a, b])
    assert not on.report["plan_cache"]["hit"] and len(on.kernels) == 2
    torch.backends.cuda.matmul.allow_tf32 = False
    again = eqfuse.compile(_mm, [a, b])
    assert again.report["plan_cache"]["hit"] and again.source == off.source
