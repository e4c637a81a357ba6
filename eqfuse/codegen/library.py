"""Plain matrix products handed to cuBLAS.

A kernel that is one matrix product and nothing else (its operands read as stored,
through index maps only; its output stored as it comes out, no activation, no
dequantisation; at most a matrix read as stored added, which cuBLAS adds in its epilogue:
``torch.addmm``) gains nothing from being generated: there is nothing to fuse, and
cuBLAS's kernels are the mark a generated product is measured against. Triton's were
up to 9% behind at square fp16 and bf16 sizes, 1.3x behind under TF32 (where Hopper's
instruction wants B K-major and the generated plan first copies it) and 1.4x behind at
GPT-2's weight gradients ([3072 x 8192] @ [8192 x 768]: 82.9 us against 58.4, too few
output tiles for the SMs); it led by 1-3% at two shapes of nine (an H100,
benchmarks/results/matmul-cublas_*.json, matmul-library_*.json). So where the plan runs on
a GPU, such a kernel becomes a ``LibraryCall`` step: ``torch.mm`` (``torch.bmm`` over a
batch) on strided views of the buffers, writing into the planned output buffer (``out=``),
so that the steps around it read it as planned. Torch's own settings apply as in eager
(``allow_tf32``, fp16 reduced-precision reduction).

A long dim that a matrix runs along with unit stride and that is not a whole number of 16
bytes sends cuBLAS to kernels that load one element at a time, whatever the other strides
(GPT-2's vocabulary of 50257 in its training step, H200: the input's gradient, K = 50257,
2553 us against 439 at K = 50256; the weight's, M = 50257, 769 against 528;
benchmarks/results/odd-dims_*.json). Such a dim is split (``split``): its first part a
whole number of 16 bytes, one call, its tail of a few elements another, M and N into
blocks of the output, K into a tail product written first and the main one added onto it
(``addmm_``: the sum rounded once more only at the tail's share). The split GPT-2 products
took 457 and 497 us, as Inductor's zero-padded copies (``pad_mm``) do without the copies.

Only layouts cuBLAS takes as they are, at full speed: each matrix with a unit stride
along one of its two dims and the other at least that dim's length and a multiple of 16
bytes (torch would copy any other operand first, and compute any other output apart
and copy it in), a batch that flattens to one
dim. Everything else, and every product with work around it, stays a generated kernel,
as do exports (runtime/exported.py runs cubins only). A sized module (codegen/sized.py)
writes the views' sizes that follow the dynamic one over ``SIZE``, as it does its
buffers'; a product cuBLAS takes at one size and not at the next keeps the graph
compiled per size. ``EQFUSE_CUBLAS=0`` or the option
``cublas=False`` keeps every product generated; tests set ``FORCE`` to make the calls on
the CPU too.
"""

from __future__ import annotations

from ..runtime.cache import switched_on
from ..schema.plan import KernelSpec, LibraryCall, Plan, PNode
from ..schema.values import BufRef
from .access import meta_view, strided_view

ENV = "EQFUSE_CUBLAS"
DTYPES = ("float16", "bfloat16", "float32")
FORCE = False  # tests: library calls on the CPU too (torch.mm there), to check the steps around them


def enabled(option: bool = True) -> bool:
    """``option``, unless ``EQFUSE_CUBLAS`` says 0, false, off or no (a plan cache key holds this)."""
    return switched_on(ENV, option)


def wanted(device_type: str, option: bool = True) -> bool:
    """Whether a plan run on ``device_type`` makes its plain products library calls."""
    return (device_type == "cuda" or FORCE) and enabled(option)


def library_products(plan: Plan, split: bool = True) -> None:
    """Rewrite ``plan`` in place: each kernel that is a plain product cuBLAS takes as laid
    out becomes a LibraryCall (``split``: with its long odd dims split off; a sized module's
    sizes follow the dynamic one, so it keeps such a product generated). Running it again
    changes nothing."""
    plan.steps[:] = [(library_call(s, plan.buffers, split) or s) if isinstance(s, KernelSpec) else s
                     for s in plan.steps]


def library_call(spec: KernelSpec, buffers: dict, split: bool = True) -> LibraryCall | None:
    """The LibraryCall computing ``spec``, or None where it is not one plain product of
    layouts cuBLAS takes, or one plus a matrix read as stored (``torch.addmm``: cuBLAS adds
    it as the product's epilogue, a residual or a tied weight's other gradient), or a sum
    of such products (each further one added onto the output: ``addmm_``; a training
    step's gradient of an input that two projections read). A K that an operand runs
    along with unit stride and that is not a whole number of 16 bytes is split off where
    ``split`` and long enough (``odd_dims``), else the kernel stays generated; such an M
    or N is split off likewise, else left to cuBLAS as it is. A sum of products takes no
    odd dims."""
    if len(spec.roots) != 1:
        return None
    root, out = spec.roots[0]
    products, added = _summands(root)
    if not products:
        return None
    added_read = strided_view(added) if added is not None else None
    first = _plain_product(products[0], buffers[out], added_read)
    if first is None or (added is not None and added.dtype != first[0].dtype):
        return None
    product, matrices, batched = first
    itemsize = ITEMSIZE[product.dtype]
    summed = []
    for term in products[1:]:
        more = _plain_product(term, buffers[out])
        if more is None or more[2] != batched or odd_dims(more[1], itemsize):
            return None
        summed.append(tuple(more[1]))
    op = ("baddbmm" if batched else "addmm") if added is not None else ("bmm" if batched else "mm")
    *_, m, n = product.shape
    k = product.args[0].shape[-1]
    odd = odd_dims(matrices, itemsize)
    if odd and summed:
        return None
    tail_at = {dim: size - size % (ALIGNMENT // itemsize) for dim, size in odd.items()
               if split and size >= MIN_SPLIT}
    if "k" in odd and "k" not in tail_at:
        return None
    batch = f"{matrices[-1].shape[0]} x " if batched else ""
    further = "".join(f" + [{m} x {a.shape[-1]}] @ [{a.shape[-1]} x {n}]" for a, _, _ in summed)
    plus = " + a matrix" if added is not None else ""
    splits = "".join(f", {dim.upper()} split {at} + {odd[dim] - at}" for dim, at in tail_at.items())
    return LibraryCall(spec.name, op, matrices[:-1], matrices[-1],
                       f"{batch}[{m} x {k}] @ [{k} x {n}]{further}{plus} {product.dtype}{splits}",
                       list(spec.fx_nodes), tuple(tail_at.items()), tuple(summed))


def _summands(root: PNode) -> tuple:
    """([the terms of ``root``'s sum that are products under index maps], the term that is
    a plain read, or None): ``root`` a product, or a tree of adds over products and at most
    one plain read; ([], None) for anything else."""
    terms, stack = [], [root]
    while stack:
        node = stack.pop()
        if node.op == "binary" and node.attrs[0] == "add" and node.dtype == root.dtype:
            stack += reversed(node.args)
        else:
            terms.append(node)
    products, reads = [], []
    for term in terms:
        inner = term
        while inner.op in ("reshape", "permute"):
            inner = inner.args[0]
        if inner.op == "dot":
            products.append(term)
        elif len(terms) > 1 and strided_view(term) is not None:
            reads.append(term)
        else:
            return [], None
    if len(reads) > 1:
        return [], None
    return products, (reads[0] if reads else None)


def _plain_product(term: PNode, buffer, added_read: tuple | None = None) -> tuple | None:
    """(the product, [BufRefs of its left and right matrices, ``added_read``'s matrix if
    given, the output's], whether batched) where ``term`` is a product under index maps of
    layouts cuBLAS takes as they are, written through them into ``buffer``; else None."""
    product, out_view, added_view = _product_output(term, buffer, added_read)
    if product is None or product.op != "dot" or 0 in product.shape or product.args[0].shape[-1] == 0:
        return None
    a, b = product.args
    if not (a.dtype == b.dtype == product.dtype == buffer.dtype and product.dtype in DTYPES):
        return None
    views = [strided_view(a), strided_view(b), (buffer.name, out_view)]
    if any(v is None or v[1] is None for v in views):
        return None
    batched = len(product.shape) > 2
    matrices = []
    for buf, t in views:
        t = _as_batch(t, batched)
        if t is None or not blas_layout(t.shape[-2:], t.stride()[-2:]) or not aligned(t, ITEMSIZE[product.dtype]):
            return None
        matrices.append(BufRef(buf, tuple(t.shape), tuple(t.stride()), t.storage_offset()))
    if added_read is not None:  # torch adds it in any layout (it copies it into the output first)
        t = _as_batch(added_view[1], batched) if added_view is not None else None
        if t is None or 0 in t.stride():  # a bias broadcast over rows: the generated kernel's epilogue reads it once
            return None
        matrices.insert(2, BufRef(added_view[0], tuple(t.shape), tuple(t.stride()), t.storage_offset()))
    return product, matrices, batched


def _as_batch(t, batched: bool):
    """``t``, a batch of any rank viewed as one dim as bmm takes it; None where no view does."""
    try:
        return t.view(-1, *t.shape[-2:]) if batched else t
    except RuntimeError:
        return None


def torch_calls(call: LibraryCall) -> list[tuple]:
    """(op, operands, out, accumulate) for each torch call that runs ``call``, in order:
    ``torch.<op>(*operands, out=out)``, or with ``accumulate`` ``out.<op>_(*operands)``.
    One, or with odd dims split: one per block of the output (M, N), each block two where
    K is split, the tail's product first (the matrix added with it), then the main
    product added onto it; then each summed product added onto the output."""
    a, b, *added = call.operands
    split = dict(call.split)
    (m, k), n = a.shape[-2:], b.shape[-1]
    accumulate = "baddbmm" if call.op in ("bmm", "baddbmm") else "addmm"  # out += a @ b

    def parts(dim, size):
        return [(0, size)] if dim not in split else [(0, split[dim]), (split[dim], size)]

    calls = []
    for rows in parts("m", m):
        for cols in parts("n", n):
            out, plus = _window(call.out, rows, cols), [_window(x, rows, cols) for x in added]
            if "k" not in split:
                calls.append((call.op, [_window(a, rows, (0, k)), _window(b, (0, k), cols), *plus], out, False))
                continue
            main, tail = (0, split["k"]), (split["k"], k)
            calls.append((call.op, [_window(a, rows, tail), _window(b, tail, cols), *plus], out, False))
            calls.append((accumulate, [_window(a, rows, main), _window(b, main, cols)], out, True))
    calls += [(accumulate, [left, right], into, True) for left, right, into in call.summed]
    return calls


def _window(ref: BufRef, rows: tuple, cols: tuple) -> BufRef:
    """Rows ``rows`` and columns ``cols`` ([start, stop)) of the matrices ``ref`` views."""
    s_rows, s_cols = ref.strides[-2:]
    offset = ref.offset + rows[0] * s_rows + cols[0] * s_cols
    return BufRef(ref.buf, (*ref.shape[:-2], rows[1] - rows[0], cols[1] - cols[0]), ref.strides, offset)


ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
ALIGNMENT = 16  # bytes


def aligned(t, itemsize: int) -> bool:
    """Whether every stride but the unit one, and the offset, of the matrices ``t`` are
    multiples of 16 bytes. cuBLAS takes the others with kernels that load one element at
    a time: GPT-2's LM head (a vocabulary of 50257, the logits' rows 50257 apart) ran
    ``cutlass_75_tensorop_bf16_s1688gemm_bf16_128x128_tn_align1`` in 3362 us on an H200,
    where torch.compile, padding the rows, took 441 (benchmarks/results/zoo_*.json)."""
    strides = [s for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1]
    return all((s * itemsize) % ALIGNMENT == 0 for s in (*strides, t.storage_offset()))


MIN_SPLIT = 1024  # elements: a shorter odd dim is not split (a second call costs more than it gains)


def odd_dims(matrices: list, itemsize: int) -> dict:
    """dim ("m", "n", "k") -> its size, for the dims of the product of ``matrices`` ([a, b,
    the matrix added if any, out] as BufRefs) that one of them runs along with unit stride
    and that are not a whole number of 16 bytes long: cuBLAS then takes kernels that load
    one element at a time, however the rows are aligned (GPT-2's logits gradient times the embedding, K =
    50257 with its rows padded: ``cutlass_75_tensorop_bf16_s1688gemm_bf16_256x128_nn_align1``,
    2546 us on an H200; a Triton kernel took 1513)."""
    odd = {}
    for ref, dims in zip(matrices, [("m", "k"), ("k", "n")] + [("m", "n")] * (len(matrices) - 2)):
        for dim, size, stride in zip(dims, ref.shape[-2:], ref.strides[-2:]):
            if stride == 1 and size > 1 and (size * itemsize) % ALIGNMENT:
                odd[dim] = size
    return odd


def blas_layout(shape, strides) -> bool:
    """Whether a matrix of ``shape`` with these strides is one cuBLAS reads or writes as
    laid out: row-major or column-major, the leading stride at least the row (column)."""
    (rows, cols), (s_rows, s_cols) = shape, strides
    return (s_cols == 1 and s_rows >= max(1, cols)) or (s_rows == 1 and s_cols >= max(1, rows))


def _product_output(root: PNode, buffer, read: tuple | None = None) -> tuple:
    """(the product under ``root``'s reshapes and permutes, the meta view of ``buffer``
    it would be written through, ``read`` (a matrix added: its ``strided_view``) viewed
    alike, or None), or (None, None, None) where ``root`` is something else."""
    views = [meta_view(buffer.shape, buffer.layout)]
    if read is not None:
        views.append(read[1])
    node = root
    try:
        while node.op in ("reshape", "permute"):
            inner = node.args[0]
            if node.op == "reshape":
                views = [v.view(inner.shape) for v in views]
            else:
                inverse = sorted(range(len(node.attrs[0])), key=node.attrs[0].__getitem__)
                views = [v.permute(*inverse) for v in views]
            node = inner
    except RuntimeError:  # a reshape no view of the buffer's strides makes
        return None, None, None
    return node, views[0], ((read[0], views[1]) if read is not None else None)
