"""The decompositions eqfuse adds to torch's, for ops its kernels compute in other terms:
each takes the op's arguments and returns its result in ops eqfuse has kernel forms for,
or NotImplemented where it does not apply (the op then stays itself, an eager step with
its reason). ``ADDED`` maps each op to its decomposition (frontend/capture.py puts them
in the table it traces with)."""

from __future__ import annotations

import itertools
import math

import torch

aten = torch.ops.aten


# Prefix sums as row sums: element i of a cumulative sum is the sum over j of x[j] where j
# <= i, a reduction over a triangle of the row that a kernel reads in place (no n x n
# tensor is stored). Its work is n times the input's, so only inputs whose elements times
# the summed length stay below this take it (RoBERTa's and OPT's position ids, 8 x 512 or 4
# x 1024 tokens; a mixture of experts' counts), the others run ATen's scan in eager.
CUMSUM_WORK = 1 << 24


def _cumsum_as_row_sums(x, dim, dtype=None):
    if dtype is None and not (x.is_floating_point() or x.is_complex()):
        dtype = torch.int64  # as torch: integers and bools sum in int64
    x = x.to(dtype) if dtype is not None else x
    prefixes = _prefixes(x, dim, 0)
    if prefixes is None:
        return NotImplemented
    return prefixes.sum(-1, dtype=x.dtype).movedim(-1, dim)  # int32 stays int32


def _upto(n: int, device) -> torch.Tensor:
    """[i, j]: j <= i, the triangle of a row's prefixes."""
    index = torch.arange(n, device=device)
    return index[None, :] <= index[:, None]


def _prefixes(x, dim: int, fill=None):
    """Each element's prefix of its row, the rest ``fill``: [..., i, j] = x[..., j] where
    j <= i (``dim`` moved last), for scans done as row reductions; None past CUMSUM_WORK.
    No ``fill``: the row's first element, which every prefix holds (a neutral filler for
    a max or a min in any dtype: int64's largest is no constant a term holds exactly)."""
    n = x.shape[dim] if x.dim() else 1
    if x.dim() == 0 or x.numel() * n > CUMSUM_WORK:
        return None
    rows = x.movedim(dim, -1).unsqueeze(-2)  # [..., 1, n]
    filler = rows[..., :1] if fill is None else torch.full((), fill, dtype=x.dtype, device=x.device)
    return torch.where(_upto(n, x.device), rows, filler)


def _holds(x, extreme):
    """Where ``x`` holds ``extreme``: equal to it (-0.0 and 0.0 alike, as torch compares
    them), or NaN where it is NaN (torch's max and min are NaN wherever one is)."""
    hit = x == extreme
    return hit | (extreme.isnan() & x.isnan()) if x.is_floating_point() else hit


def _running_extreme(x, dim: int, largest: bool):
    """``cummax`` / ``cummin``: the extreme of each prefix (NaN from the first NaN on) and
    the last position in the prefix holding it (torch's: ties and NaN the latest)."""
    if x.dtype == torch.bool or x.dim() == 0:
        return NotImplemented
    prefixes = _prefixes(x, dim)
    if prefixes is None:
        return NotImplemented
    values = (prefixes.amax(-1) if largest else prefixes.amin(-1)).unsqueeze(-1)
    rows = x.movedim(dim, -1).unsqueeze(-2)
    n = rows.shape[-1]
    positions = torch.where(_upto(n, x.device) & _holds(rows, values), torch.arange(n, device=x.device), -1).amax(-1)
    values = values.squeeze(-1)
    return values.movedim(-1, dim), positions.movedim(-1, dim)


def _cummax(x, dim):
    return _running_extreme(x, dim, largest=True)


def _cummin(x, dim):
    return _running_extreme(x, dim, largest=False)


def _logcumsumexp(x, dim):
    """The log of each prefix's sum of exponentials, its largest taken out first (an
    infinite largest: 0 taken out, so that +inf stays inf and -inf gives -inf)."""
    if not x.is_floating_point():
        return NotImplemented
    prefixes = _prefixes(x, dim, float("-inf"))
    if prefixes is None:
        return NotImplemented
    top = prefixes.amax(-1, keepdim=True)
    top = torch.where(top.isinf(), 0.0, top)
    return (top.squeeze(-1) + (prefixes - top).exp().sum(-1).log()).movedim(-1, dim)


def _flip_as_reads(x, dims):
    """``flip``: each flipped dim read backwards (index_select of a descending arange,
    an indexed read that the kernel computes the index of as it goes). A 0-d tensor (its
    dim 0 or -1 is itself) and no dims at all give a copy."""
    if x.dim() == 0 or not dims:
        return x.clone()
    for d in dims:
        n = x.shape[d]
        x = x.index_select(d, torch.arange(n - 1, -1, -1, device=x.device))
    return x


def _unfold_as_reads(x, dimension, size, step):
    """``Tensor.unfold``: the windows along ``dimension`` read at their positions (an
    index_select of window start times ``step`` plus offset, computed as the kernel goes),
    each window's elements last. A copy where eager returns a view (equal values). A 0-d
    tensor is one window of itself."""
    if x.dim() == 0:
        return x.reshape(1) if size == 1 else NotImplemented
    d = dimension % x.dim()
    n = (x.shape[d] - size) // step + 1
    start = torch.arange(n, device=x.device)[:, None] * step
    picked = x.index_select(d, (start + torch.arange(size, device=x.device)[None, :]).reshape(-1))
    return picked.reshape(tuple(x.shape[:d]) + (n, size) + tuple(x.shape[d + 1:])).movedim(d + 1, -1)


def _position_of(x, dim: int | None, keepdim: bool, largest: bool):
    """``argmax`` (``largest``) or ``argmin`` as two reductions a kernel fuses: the row's
    extreme (NaN where the row has one, as torch's), then the first position holding it
    (a NaN's where it is NaN; -0.0 and 0.0 alike, as torch compares them)."""
    if dim is None:
        x, dim = x.reshape(-1), 0
    if x.dim() == 0:
        return torch.zeros((), dtype=torch.int64, device=x.device)
    dim = dim % x.dim()
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    extreme = x.amax(dim, keepdim=True) if largest else x.amin(dim, keepdim=True)
    n = x.shape[dim]
    position = torch.arange(n, device=x.device).reshape([n] + [1] * (x.dim() - 1 - dim))
    return torch.where(_holds(x, extreme), position, n).amin(dim, keepdim=keepdim)


def _argmax(x, dim=None, keepdim=False):
    if x.dtype == torch.bool:
        return NotImplemented  # eager refuses bools: so does the graph, in its eager step
    return _position_of(x, dim, keepdim, largest=True)


def _argmin(x, dim=None, keepdim=False):
    if x.dtype == torch.bool:
        return NotImplemented
    return _position_of(x, dim, keepdim, largest=False)


# topk of up to this many is that many passes over the row (a mixture of experts' top 2
# of 8); more stays ATen's sort-based kernel
TOPK_PASSES = 4


def _topk(x, k, dim=-1, largest=True, sorted=True):
    """The ``k`` largest of each row as ``k`` passes: each the largest of the elements not
    taken yet (NaN the largest, as torch's) and the first position holding it. Ties go
    to the lowest position (torch leaves their order open). The smallest, and more than
    TOPK_PASSES: the row sorted by ranks (``_sorted``), its first ``k``."""
    if type(k) is not int or x.dim() == 0 or not 0 <= k <= x.shape[dim]:
        return NotImplemented  # (eager's error past the row)
    if _ties_likely(x):
        return NotImplemented
    if not largest or not 0 < k <= TOPK_PASSES:
        made = _sorted(x, dim, descending=largest)
        return made if made is NotImplemented else tuple(t.narrow(dim, 0, k) for t in made)
    rows = x.movedim(dim, -1)
    n = rows.shape[-1]
    position = torch.arange(n, device=x.device)
    taken = torch.zeros(rows.shape, dtype=torch.bool, device=x.device)
    values, indices = [], []
    for _ in range(k):
        top = torch.where(taken, float("-inf"), rows).amax(-1, keepdim=True)
        at = torch.where(_holds(rows, top) & ~taken, position, n).amin(-1, keepdim=True)
        values.append(top)
        indices.append(at)
        taken = taken | (position == at)
    return torch.cat(values, -1).movedim(-1, dim), torch.cat(indices, -1).movedim(-1, dim)


def _ranks(rows, descending: bool):
    """Each element's place in its row (the last dim) sorted stably, NaN the largest as
    torch sorts: the count of the row's elements that go before it, a reduction over the
    row's pairs."""
    if rows.dtype == torch.bool:
        rows = rows.to(torch.uint8)
    mine, theirs = rows.unsqueeze(-1), rows.unsqueeze(-2)  # [..., i, 1], [..., 1, j]
    before = theirs > mine if descending else theirs < mine
    same = theirs == mine
    if rows.is_floating_point():
        nan_mine, nan_theirs = mine.isnan(), theirs.isnan()
        before = before | ((nan_theirs & ~nan_mine) if descending else (nan_mine & ~nan_theirs))
        same = same | (nan_mine & nan_theirs)
    n = rows.shape[-1]
    earlier = torch.arange(n, device=rows.device) < torch.arange(n, device=rows.device).unsqueeze(-1)  # [i, j]: j < i
    return (before | (same & earlier)).sum(-1)


def _sorted(x, dim=-1, descending=False):
    """``sort`` (stable, as ``stable=True``; torch leaves the order of ties open
    otherwise) by ranks: each place's index is the position whose rank it is (a
    reduction over the row), its value read there. The row's pairs are its work:
    past CUMSUM_WORK it stays ATen's."""
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
    dim %= x.dim()
    n = x.shape[dim]
    if type(n) is not int or x.numel() * n > CUMSUM_WORK or x.is_complex():
        return NotImplemented
    rows = x.movedim(dim, -1)
    ranks = _ranks(rows, descending).unsqueeze(-2)  # [..., 1, i]
    place = torch.arange(n, device=x.device).unsqueeze(-1)  # [r, 1]
    indices = torch.where(ranks == place, torch.arange(n, device=x.device), 0).sum(-1)  # [..., r]
    return torch.gather(rows, -1, indices).movedim(-1, dim), indices.movedim(-1, dim)


# Where torch leaves the order of ties open (sort without stable=True, topk, kthvalue,
# median), integers and bools stay ATen's: their ties are common (a mixture of experts
# sorts its tokens' expert ids) and eager's order of them is its algorithm's; a plan
# that orders them otherwise lays out every output that follows otherwise, which
# validation then cannot compare (rewrite/validate.order_dependent_outputs).
def _ties_likely(x) -> bool:
    return not x.is_floating_point()


def _sort(x, dim=-1, descending=False):
    return NotImplemented if _ties_likely(x) else _sorted(x, dim, descending)


def _sort_stable(x, *, stable=None, dim=-1, descending=False):
    return NotImplemented if _ties_likely(x) and not stable else _sorted(x, dim, descending)


def _kthvalue(x, k, dim=-1, keepdim=False):
    """The ``k``-th smallest of each row (NaN the largest) and its position, from the sort."""
    if _ties_likely(x) or (x.dim() and not 0 < k <= x.shape[dim]):
        return NotImplemented  # (past the row: eager's error)
    made = _sorted(x, dim)
    if made is NotImplemented or x.dim() == 0:
        return made
    return tuple(t.narrow(dim, k - 1, 1) if keepdim else t.select(dim, k - 1) for t in made)


def _median_dim(x, dim, keepdim=False, ignore_nan=False):
    """The lower median of each row and its position: the sorted row's middle place, of
    the row's numbers where ``ignore_nan`` (``nanmedian``), else NaN and the first NaN's
    position where the row has one (as torch's)."""
    if _ties_likely(x):
        return NotImplemented
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
    dim %= x.dim()
    made = _sorted(x, dim)
    if made is NotImplemented or x.shape[dim] == 0:
        return NotImplemented
    values, indices = made
    n = x.shape[dim]
    nan = x.isnan() if x.is_floating_point() else torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    counted = n - nan.sum(dim, keepdim=True) if ignore_nan else torch.full_like(nan.sum(dim, keepdim=True), n)
    middle = ((counted - 1) // 2).clamp(min=0)
    value, index = torch.gather(values, dim, middle), torch.gather(indices, dim, middle)
    if not ignore_nan and x.is_floating_point():  # NaN in the row: NaN, at the first NaN
        first_nan = _position_of(nan.to(torch.uint8), dim, True, largest=True)
        held = nan.any(dim, keepdim=True)
        value, index = torch.where(held, values.narrow(dim, n - 1, 1), value), torch.where(held, first_nan, index)
    return (value, index) if keepdim else (value.squeeze(dim), index.squeeze(dim))


def _median(x):
    made = _median_dim(x.reshape(-1), 0) if x.numel() else NotImplemented
    return made if made is NotImplemented else made[0]


def _nanmedian(x):
    made = _median_dim(x.reshape(-1), 0, ignore_nan=True) if x.numel() else NotImplemented
    return made if made is NotImplemented else made[0]


def _nanmedian_dim(x, dim, keepdim=False):
    return _median_dim(x, dim, keepdim, ignore_nan=True)


def _max_with_index(x, dim, keepdim=False):
    return x.amax(dim, keepdim=keepdim), _position_of(x, dim, keepdim, largest=True)


def _min_with_index(x, dim, keepdim=False):
    return x.amin(dim, keepdim=keepdim), _position_of(x, dim, keepdim, largest=False)


def _max_of_all(x):
    return x.amax() if x.numel() else NotImplemented  # (eager's error for no elements)


def _min_of_all(x):
    return x.amin() if x.numel() else NotImplemented


def _patch_rows(x, weight, stride, padding, dilation, transposed, groups):
    """The patches of a convolution whose windows tile the input (stride = kernel size, no
    padding, no dilation, one group), a view of the input laid out as rows of C x k x k in
    the weight's order, and the output's spatial sizes; else None."""
    kernel = list(weight.shape[2:])
    spatial = list(x.shape[2:])
    if (transposed or groups != 1 or any(padding) or any(d != 1 for d in dilation) or list(stride) != kernel
            or not kernel or len(spatial) != len(kernel) or any(s < k for s, k in zip(spatial, kernel))):
        return None
    dims = len(kernel)
    out = [s // k for s, k in zip(spatial, kernel)]
    for d, (o, k) in enumerate(zip(out, kernel)):  # the rows and columns past the last window are not read
        x = x.narrow(2 + d, 0, o * k)
    batch, channels = x.shape[0], x.shape[1]
    tiled = x.reshape([batch, channels] + [n for o, k in zip(out, kernel) for n in (o, k)])
    # [batch, o1, o2, .., channels, k1, k2, ..]: one patch per row, in the weight's order
    order = [0] + [2 + 2 * d for d in range(dims)] + [1] + [3 + 2 * d for d in range(dims)]
    return tiled.permute(order).reshape(batch * math.prod(out), channels * math.prod(kernel)), out


def _patches_as_product(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """A convolution whose windows tile the input (a vision transformer's patch embedding,
    a 1x1 convolution) as the matrix product it is: the patches (``_patch_rows``) times
    the weight's rows. The product reads the patches through that view (no copy where the
    kernel can index it); the output comes back as the convolution's shape, in
    channels-last memory, which the patch embedding's ``flatten(2).transpose(1, 2)`` makes
    contiguous rows again. Other convolutions stay ATen's (cuDNN)."""
    tiling = _patch_rows(x, weight, stride, padding, dilation, transposed, groups)
    if tiling is None:
        return NotImplemented
    rows, out = tiling
    y = rows @ weight.reshape(weight.shape[0], -1).t()
    if bias is not None:
        y = y + bias
    dims = len(out)
    return y.reshape([x.shape[0]] + out + [weight.shape[0]]).permute([0, dims + 1] + list(range(1, dims + 1)))


def _patches_backward(grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                      output_mask):
    """``convolution_backward`` of a convolution whose windows tile the input: the
    products of its forward transposed. The weight's gradient is the output gradient's
    rows times the patches, the input's is the rows times the weight laid back over the
    windows (zero past the last one), the bias's the rows' sum."""
    tiling = _patch_rows(x, weight, stride, padding, dilation, transposed, groups)
    if tiling is None:
        return NotImplemented
    rows, out = tiling
    dims, outputs, kernel = len(out), weight.shape[0], list(weight.shape[2:])
    g = grad.permute([0] + list(range(2, dims + 2)) + [1]).reshape(-1, outputs)  # one row per patch
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        patches = (g @ weight.reshape(outputs, -1)).reshape([x.shape[0]] + out + [x.shape[1]] + kernel)
        order = [0, dims + 1] + [n for d in range(dims) for n in (1 + d, dims + 2 + d)]
        grad_input = patches.permute(order).reshape(list(x.shape[:2]) + [o * k for o, k in zip(out, kernel)])
        past = [n for s, o, k in reversed(list(zip(x.shape[2:], out, kernel))) for n in (0, s - o * k)]
        if any(past):
            grad_input = aten.constant_pad_nd(grad_input, past, 0.0)
    if output_mask[1]:
        grad_weight = (g.t() @ rows).reshape(weight.shape)
    if output_mask[2]:
        grad_bias = g.sum(0)
    return grad_input, grad_weight, grad_bias


def _cumprod_as_row_products(x, dim, dtype=None):
    """``cumprod`` as ``cumsum`` is: each element the product over the triangle of its row
    up to it (floats only: integer products stay exact in ATen's scan)."""
    x = x.to(dtype) if dtype is not None else x
    prefixes = _prefixes(x, dim, 1) if x.is_floating_point() else None
    if prefixes is None:
        return NotImplemented
    return prefixes.prod(-1).movedim(-1, dim)


# Pooling windows of up to this many elements are summed (or compared) as that many
# strided views of the input, each one load of the kernel; larger ones stay ATen's unless
# they tile the input (a reduction over each tile then).
WINDOW_VIEWS = 64


def _windows(x, kernel, stride, padding, fill: float):
    """The views of ``x`` (padded with ``fill``) that line up one element of each pooling
    window with each output: k1 x k2 x ... strided slices, which a kernel reads in place."""
    dims = len(kernel)
    spatial = x.shape[-dims:]
    out = [(n + 2 * p - k) // s + 1 for n, k, s, p in zip(spatial, kernel, stride, padding)]
    if (any(p > k // 2 for p, k in zip(padding, kernel)) or any(o <= 0 for o in out)
            or math.prod(kernel) > WINDOW_VIEWS):
        return None, None
    pads = [p for pad in reversed(padding) for p in (pad, pad)]
    padded = torch.nn.functional.pad(x, pads, value=fill) if any(padding) else x
    views = []
    for offsets in itertools.product(*(range(k) for k in kernel)):
        view = padded
        for d, (o, s, n) in enumerate(zip(offsets, stride, out)):
            axis = view.dim() - dims + d
            every = [slice(None)] * view.dim()
            every[axis] = slice(None, None, s)
            view = view.narrow(axis, o, s * (n - 1) + 1)[tuple(every)]
        views.append((offsets, view))
    return views, out


def _avg_pool(x, kernel, stride, padding, ceil_mode=False, count_include_pad=True, divisor_override=None):
    """Average pooling: the mean of each tile where the windows tile the input, else the
    sum of the windows' strided views over their count."""
    if ceil_mode:
        return NotImplemented  # windows past the edge count otherwise
    tiles = _tiles(x, kernel, stride, padding)
    if tiles is not None:
        within = [2 * i + 1 - 2 * len(kernel) for i in range(len(kernel))]
        return tiles.mean(within) if divisor_override is None else tiles.sum(within) / divisor_override
    views, out = _windows(x, kernel, stride, padding, 0.0)
    if views is None:
        return NotImplemented
    total = views[0][1]
    for _, view in views[1:]:
        total = total + view
    if divisor_override:
        return total / divisor_override
    if count_include_pad or not any(padding):
        return total / math.prod(kernel)
    ones = torch.ones(x.shape[-len(kernel):], dtype=x.dtype, device=x.device)
    counts, _ = _windows(ones, kernel, stride, padding, 0.0)
    count = counts[0][1]
    for _, view in counts[1:]:
        count = count + view
    return total / count


def _each(values, dims: int) -> list:
    """A pooling argument per spatial dim (ATen takes one for all)."""
    return list(values) * dims if len(values) == 1 else list(values)


def _avg_pool_of(dims: int):
    def pool(x, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True,
             divisor_override=None):
        kernel = _each(kernel_size, dims)
        return _avg_pool(x, kernel, _each(stride, dims) if stride else kernel, _each(padding, dims), ceil_mode,
                         count_include_pad, divisor_override)
    return pool


def _tiles(x, kernel, stride, padding):
    """``x`` as [..., o1, k1, o2, k2, ...] where the windows tile it (stride = kernel, no
    padding, the sizes multiples of the windows), else None."""
    dims = len(kernel)
    spatial = list(x.shape[-dims:])
    if list(stride) != list(kernel) or any(padding) or any(n % k for n, k in zip(spatial, kernel)):
        return None
    return x.reshape(list(x.shape[:-dims]) + [m for n, k in zip(spatial, kernel) for m in (n // k, k)])


def _even_windows(x, output_size) -> list | None:
    """Adaptive pooling's window where each output's is the same (the input a multiple of
    the output), else None."""
    spatial = x.shape[-len(output_size):]
    if any(o == 0 or n % o for n, o in zip(spatial, output_size)):
        return None
    return [n // o for n, o in zip(spatial, output_size)]


def _adaptive_avg_pool(x, output_size):
    """Adaptive average pooling with even windows: average pooling with the window as its stride."""
    kernel = _even_windows(x, output_size)
    return NotImplemented if kernel is None else _avg_pool(x, kernel, kernel, [0] * len(kernel))


def _max_pool_with_indices(x, kernel, stride, padding, dilation=(1,), ceil_mode=False):
    """Max pooling and the flat index in its plane (or volume) of each window's first
    largest element (NaN the largest), over the windows' strided views in order."""
    dims = len(kernel)
    if ceil_mode or any(d != 1 for d in dilation) or not x.is_floating_point():
        return NotImplemented
    views, out = _windows(x, kernel, stride, padding, float("-inf"))
    if views is None:
        return NotImplemented
    spatial = x.shape[-dims:]
    starts = [(torch.arange(o, device=x.device) * s - p).reshape([o] + [1] * (dims - 1 - d))
              for d, (o, s, p) in enumerate(zip(out, stride, padding))]
    best, where = None, None
    for offsets, view in views:
        here = 0
        for d, (first, o) in enumerate(zip(starts, offsets)):  # the flat index, dim by dim
            here = here * spatial[d] + (first + o)
        if best is None:  # (a copy: one window of one element would hand back the input itself)
            best, where = view.clone(), here + torch.zeros(view.shape, dtype=torch.int64, device=x.device)
            continue
        better = (view > best) | (view.isnan() & ~best.isnan())
        best, where = torch.where(better, view, best), torch.where(better, here, where)
    return best, where


def _max_pool_with_indices_of(dims: int):
    def pool(x, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
        kernel = _each(kernel_size, dims)
        return _max_pool_with_indices(x, kernel, _each(stride, dims) if stride else kernel, _each(padding, dims),
                                      dilation, ceil_mode)
    return pool


def _adaptive_max_pool(x, output_size):
    """Adaptive max pooling with even windows: max pooling with the window as its stride."""
    kernel = _even_windows(x, output_size)
    return NotImplemented if kernel is None else _max_pool_with_indices(x, kernel, kernel, [0] * len(kernel))


def _nan_where(wrong, out):
    """``out``, NaN throughout where ``wrong`` (a 0-d bool: an argument eager raises on), for
    floats: a kernel cannot raise."""
    if not out.is_floating_point():
        return out
    return torch.where(wrong, torch.full((), math.nan, dtype=out.dtype, device=out.device), out)


def _index_put_at_many(x, indices, values, accumulate=False):
    """``index_put`` with one index tensor of several positions along one dim (a static
    cache's prompt written at its positions; index_copy, index_add and index_fill come
    here decomposed): for each position of ``x`` the last index naming it (a reduction
    over the indices), then that slot of ``values`` read there (an indexed read), ``x``
    elsewhere; where accumulating, each position's sum of the values naming it. An index
    outside ``x`` (eager raises) gives NaN throughout, for floats. One position is the
    pointwise write of schema/handlers/indexing.py; a boolean mask (nonzero: a shape from
    the values) and writes past CUMSUM_WORK comparisons stay ATen's."""
    given = [d for d, i in enumerate(indices) if i is not None]
    if len(given) != 1:
        return NotImplemented
    (dim,) = given
    index = indices[dim]
    n, count = x.shape[dim] if x.dim() else 0, index.numel()
    if (index.dim() != 1 or index.dtype == torch.bool or index.is_floating_point() or type(n) is not int
            or type(count) is not int or count <= 1):
        return NotImplemented
    slots = list(x.shape)
    slots[dim] = count
    rest = math.prod(slots) // count
    if n * count * (rest if accumulate else 1) > CUMSUM_WORK:
        return NotImplemented
    written = torch.broadcast_to(values.to(x.dtype), slots)
    wrapped = torch.where(index < 0, index + n, index)
    naming = wrapped.unsqueeze(0) == torch.arange(n, device=x.device).unsqueeze(1)  # [position, index]
    if accumulate:  # positions no index names keep x as it is (its -0.0 too: x + 0 would not)
        summed = torch.where(naming, written.movedim(dim, -1).unsqueeze(-2), 0).sum(-1, dtype=x.dtype)
        named = naming.any(1).reshape([n] + [1] * (x.dim() - 1 - dim))
        out = torch.where(named, x + summed.movedim(-1, dim), x)
    else:
        last = torch.where(naming, torch.arange(count, device=x.device), -1).amax(1)  # [position]
        taken = written.index_select(dim, last.clamp(min=0))
        here = (last >= 0).reshape([n] + [1] * (x.dim() - 1 - dim))
        out = torch.where(here, taken, x)
    return _nan_where(((index < -n) | (index >= n)).any(), out)


def _index_put_in_place_at_many(x, indices, values, accumulate=False):
    made = _index_put_at_many(x, indices, values, accumulate)
    return made if made is NotImplemented else x.copy_(made)


def _histc(x, bins=100, min=0, max=0):
    """``histc`` with its range given (a mixture of experts' tokens per expert): each bin's
    count of the elements that fall in it (bins x elements comparisons, a reduction),
    each element's bin ``(x - min) * bins / (max - min)`` as torch computes it, the top
    edge in the last bin, elements outside the range (and NaN) in none. A range taken
    from the data (min = max) stays ATen's, and so do half widths, whose bins ATen finds
    in its own rounding (an element on an edge may land in the next bin in float32)."""
    if (not max > min or x.numel() * bins > CUMSUM_WORK or x.dtype in (torch.bool, torch.float16, torch.bfloat16)
            or (not x.is_floating_point() and x.dtype.itemsize > 4)):
        return NotImplemented
    value = x.reshape(-1)
    value = value if value.is_floating_point() else value.to(torch.float32)
    inside = (value >= min) & (value <= max)
    value = torch.where(inside, value, min)  # NaN and infinities are in no bin, and no integer
    which = ((value - min) * bins / (max - min)).floor().to(torch.int64)
    which = torch.where(value == max, bins - 1, which)
    falls = (which.unsqueeze(0) == torch.arange(bins, device=x.device).unsqueeze(1)) & inside.unsqueeze(0)
    return falls.sum(1).to(x.dtype)


# The reductions a scatter combines the values naming one position with (as
# scatter_reduce names them), and the value that leaves each unchanged where it has one.
_SCATTER_REDUCTIONS = {"sum": 0, "prod": 1, "amax": float("-inf"), "amin": float("inf"), "mean": 0, "assign": None}


def _scattered(x, dim, index, src, reduce: str, include_self: bool = True):
    """``scatter_reduce`` (``scatter``: ``reduce`` "assign", the last value naming a
    position) as reductions over the index: for each position along ``dim`` of each row,
    the values whose index names it, combined (with ``x``'s own where ``include_self``);
    positions no index names keep ``x``'s value as it is (-0.0 too), and so do rows past
    the index's extent. An index outside ``x`` (eager raises) gives NaN throughout, for
    floats. Each position compares every index of its row: past CUMSUM_WORK comparisons,
    and for bools or an integer mean, the op stays ATen's."""
    if x.dim() == 0 and index.dim() == 0:  # a scalar: its one position
        made = _scattered(x.reshape(1), 0, index.reshape(1), src.reshape(1) if isinstance(src, torch.Tensor) else src,
                          reduce, include_self)
        return made if made is NotImplemented else made.reshape(())
    if x.dim() == 0 or index.dim() != x.dim() or x.dtype == torch.bool or index.numel() == 0:
        return NotImplemented
    dim %= x.dim()
    n, extent = x.shape[dim], list(index.shape)
    if type(n) is not int or n * index.numel() > CUMSUM_WORK or (reduce == "mean" and not x.is_floating_point()):
        return NotImplemented
    if isinstance(src, torch.Tensor):
        for d, e in enumerate(extent):
            src = src.narrow(d, 0, e)
        src = src.to(x.dtype)
    else:
        src = torch.full(extent, src, dtype=x.dtype, device=x.device)
    region = x
    for d, e in enumerate(extent):
        if d != dim:
            region = region.narrow(d, 0, e)
    base = region.movedim(dim, -1)  # [..., n]
    values = src.movedim(dim, -1).unsqueeze(-2)  # [..., 1, m]
    idx = index.movedim(dim, -1).unsqueeze(-2)
    naming = idx == torch.arange(n, device=x.device).unsqueeze(-1)  # [..., n, m]: value j names position i
    named = naming.any(-1)
    if reduce == "assign":
        m = extent[dim]
        last = torch.where(naming, torch.arange(m, device=x.device), -1).amax(-1)  # [..., n]
        combined = torch.gather(values.squeeze(-2), -1, last.clamp(min=0))
    elif reduce in ("amax", "amin"):
        # integers: the row's least (greatest) value fills the others, no larger than any named
        fill = _SCATTER_REDUCTIONS[reduce] if x.is_floating_point() else (
            values.amin(-1, keepdim=True) if reduce == "amax" else values.amax(-1, keepdim=True))
        picked = torch.where(naming, values, fill)
        combined = picked.amax(-1) if reduce == "amax" else picked.amin(-1)
        if include_self:
            combined = torch.maximum(base, combined) if reduce == "amax" else torch.minimum(base, combined)
    else:
        picked = torch.where(naming, values, _SCATTER_REDUCTIONS[reduce])
        combined = picked.prod(-1) if reduce == "prod" else picked.sum(-1, dtype=x.dtype)
        if include_self:
            combined = base * combined if reduce == "prod" else base + combined
        if reduce == "mean":
            combined = combined / (naming.sum(-1) + int(include_self))
    out = torch.where(named, combined, base).movedim(-1, dim)
    partial = [d for d, e in enumerate(extent) if d != dim and e < x.shape[d]]
    if partial:  # the rows past the index's extent keep x
        pads = [p for d in reversed(range(x.dim())) for p in (0, x.shape[d] - out.shape[d])]
        inside = torch.ones((), dtype=torch.bool, device=x.device)
        for d in partial:
            inside = inside & (torch.arange(x.shape[d], device=x.device) < extent[d]).reshape(
                [-1] + [1] * (x.dim() - 1 - d))
        out = torch.where(inside, aten.constant_pad_nd(out, pads, 0), x)
    return _nan_where(((index < 0) | (index >= n)).any(), out)


def _scatter_many(x, dim, index, src):
    """``scatter`` where a row's index names several positions, or reads part of a larger
    source (one each, of the index's shape: schema/handlers/indexing.py's pointwise form)."""
    one_per_row = index.dim() == x.dim() and index.shape[dim] == 1 and all(
        i == s for d, (i, s) in enumerate(zip(index.shape, x.shape)) if d != dim % max(x.dim(), 1))
    if one_per_row and (not isinstance(src, torch.Tensor) or src.shape == index.shape):
        return NotImplemented
    return _scattered(x, dim, index, src, "assign")


_SCATTER_NAMES = {"add": "sum", "multiply": "prod"}  # scatter's reduce= as scatter_reduce names it


def _scatter_reducing(x, dim, index, src, reduce):
    return _scattered(x, dim, index, src, _SCATTER_NAMES[reduce])


def _scatter_add(x, dim, index, src):
    return _scattered(x, dim, index, src, "sum")


def _scatter_reduce(x, dim, index, src, reduce, include_self=True):
    return _scattered(x, dim, index, src, reduce, include_self)


def _index_reduce(x, dim, index, source, reduce, include_self=True):
    """``index_reduce``: ``scatter_reduce`` with the index repeated along the other dims."""
    if index.dim() != 1:
        return NotImplemented
    if x.dim() == 0:  # a scalar: its one position
        made = _index_reduce(x.reshape(1), 0, index, source.reshape(1), reduce, include_self)
        return made if made is NotImplemented else made.reshape(())
    dim %= x.dim()
    spread = index.reshape([1] * dim + [-1] + [1] * (source.dim() - dim - 1)).expand(source.shape)
    return _scattered(x, dim, spread, source, reduce, include_self)


def _put(x, index, source, accumulate=False):
    """``put``: ``index_put`` along the flattened tensor (at one position, the pointwise
    write of schema/handlers/indexing.py)."""
    flat, where, values = x.reshape(-1), [index.reshape(-1)], source.reshape(-1)
    made = _index_put_at_many(flat, where, values, accumulate)
    if made is NotImplemented and index.numel() == 1:
        made = aten.index_put(flat, where, values, accumulate)
    return made if made is NotImplemented else made.reshape(x.shape)


def _masked_scatter(x, mask, source):
    """``masked_scatter``: where the mask holds, the next value of ``source`` in order,
    each position reading the one its count of earlier held places names (a prefix sum);
    NaN throughout, for floats, where the mask holds more places than ``source`` has values."""
    held = torch.broadcast_to(mask, x.shape).reshape(-1)
    if x.numel() ** 2 > CUMSUM_WORK or x.numel() == 0:
        return NotImplemented
    count = _cumsum_as_row_sums(held, 0)
    picked = source.reshape(-1)[(count - 1).clamp(min=0, max=max(source.numel() - 1, 0))]
    out = torch.where(held, picked.to(x.dtype), x.reshape(-1)).reshape(x.shape)
    return _nan_where(count[-1] > source.numel(), out)  # more places than the source has values


def _diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    """``diagonal_scatter``: ``src`` on the diagonal (``j - i == offset`` over ``dim1`` and
    ``dim2``), each place reading its diagonal element (an indexed read), ``x`` elsewhere."""
    if x.dim() < 2:
        return NotImplemented
    dim1, dim2 = dim1 % x.dim(), dim2 % x.dim()
    moved = x.movedim((dim1, dim2), (-2, -1))  # [..., n1, n2]
    n1, n2 = moved.shape[-2:]
    i = torch.arange(n1, device=x.device).unsqueeze(-1)
    j = torch.arange(n2, device=x.device)
    on = (j - i) == offset
    length = src.shape[-1]
    if length == 0:
        return x.clone()
    # each place's element along the diagonal (its row, or its column below the main one)
    place = torch.broadcast_to(i if offset >= 0 else j, (n1, n2)).clamp(max=length - 1)
    values = src.index_select(-1, place.reshape(-1)).reshape(tuple(src.shape[:-1]) + (n1, n2))
    return torch.where(on, values.to(x.dtype), moved).movedim((-2, -1), (dim1, dim2))


def _as_strided_scatter(x, src, size, stride, storage_offset=None):
    """``as_strided_scatter`` of a contiguous ``x``: ``put`` at the view's positions in
    ``x``'s elements (where the view meets a position twice, the later element, as eager's
    copy into it leaves it)."""
    if not x.is_contiguous() or len(size) != len(stride) or any(type(n) is not int for n in (*size, *stride)):
        return NotImplemented
    positions = torch.full((), storage_offset or 0, dtype=torch.int64, device=x.device)
    for d, (n, step) in enumerate(zip(size, stride)):
        positions = positions + (torch.arange(n, device=x.device) * step).reshape([n] + [1] * (len(size) - 1 - d))
    return _put(x, positions, src)


def _round_decimals(x, *, decimals):
    """``round(x, decimals=d)`` as ATen computes it: by the power of ten in ``x``'s dtype,
    multiplied (d > 0) or divided (d < 0), rounded half to even, then undone (float32:
    narrower dtypes round there in their own width)."""
    if x.dtype != torch.float32:
        return NotImplemented
    scale = float(torch.tensor(10.0 ** abs(decimals), dtype=torch.float32))
    return torch.round(x / scale) * scale if decimals < 0 else torch.round(x * scale) / scale


def _angle(x):
    """``angle`` of real numbers: pi below zero (not at -0.0), NaN at NaN, else 0."""
    if x.is_complex():
        return NotImplemented
    real = x if x.is_floating_point() else x.to(torch.get_default_dtype())
    pi = torch.where(real < 0, math.pi, 0.0).to(real.dtype)
    return torch.where(real.isnan(), real, pi)


def _addbmm(x, batch1, batch2, *, beta=1, alpha=1):
    """``addbmm``: the sum of the batch's products is one product over the batch and the
    shared dim together; ``beta * x`` added (nothing of ``x``, NaN included, where beta is 0)."""
    if not x.is_floating_point():
        return NotImplemented
    product = batch1.transpose(0, 1).reshape(batch1.shape[1], -1) @ batch2.reshape(-1, batch2.shape[2])
    if alpha != 1:
        product = product * alpha
    if beta == 0:
        return product
    return (x * beta if beta != 1 else x) + product


def _dist(x, other, p=2):
    """``dist``: the p-norm of the difference (torch's vector norm, decomposed)."""
    return torch.linalg.vector_norm(x - other, p)


def _pow_tensors(x, y):
    """``pow`` of a tensor to a tensor power with a float result, as C's pow (eager's):
    the magnitude exp2(y log2|x|), within a few ulps of powf (the product's rounding times
    the result's exponent); negative where x is negative (or -0.0) and y an odd integer;
    NaN where a finite negative x meets a finite y that is no integer; 1 where y is 0 or x
    is 1 (NaN included) and where |x| is 1 and y infinite. Computed in float32 (float64
    for float64) and rounded once to the result's dtype."""
    dtype = torch.result_type(x, y)
    if not dtype.is_floating_point:
        return NotImplemented
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    x, y = x.to(wide), y.to(wide)
    size = x.abs()
    magnitude = torch.exp2(y * torch.log2(size))
    integer = torch.trunc(y) == y
    odd = integer & (y - 2 * torch.floor(y * 0.5) == 1)
    out = torch.where(torch.signbit(x) & odd, -magnitude, magnitude)
    out = torch.where((x < 0) & torch.isfinite(x) & torch.isfinite(y) & ~integer, math.nan, out)
    return torch.where((y == 0) | (x == 1) | ((size == 1) & torch.isinf(y)), 1.0, out).to(dtype)


def _ldexp(x, other):
    """``ldexp`` of a float32 or half-precision ``x`` by integer exponents, exact as eager's
    (a true ldexp, not ``x * 2.0 ** other``: ldexp(0, 140) is 0, ldexp(1e-40, 140) finite,
    ldexp(inf, -200) inf): in float32, ``x`` times three powers of two that are each a
    normal float (the exponent clamped to +-300, past which every result is an infinity,
    a zero, or x's infinity or NaN as at +-300), rounded once to x's dtype."""
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or other.is_floating_point() \
            or other.dtype == torch.bool or torch.result_type(x, other) != x.dtype:
        return NotImplemented
    e = other.clamp(-300, 300)
    a = torch.div(e, 3, rounding_mode="trunc")
    b = torch.div(e - a, 2, rounding_mode="trunc")
    out = x.float()
    for part in (a, b, e - a - b):
        out = out * torch.exp2(part.float())
    return out.to(x.dtype)


def _frexp(x):
    """``frexp``: x as a mantissa of magnitude in [0.5, 1), of x's sign, times 2 to an
    int32 exponent; a zero, an infinity or a NaN is its own mantissa, with exponent 0 (as
    C's frexp in glibc, which eager calls). The exponent from log2|x| (within one of the
    true one, a denormal's included), corrected by the exact ldexp of x by its negation."""
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return NotImplemented
    wide = x.float()
    special = (wide == 0) | ~wide.isfinite()
    e = torch.where(special, 0.0, torch.floor(torch.log2(wide.abs())) + 1).to(torch.int32)
    m = _ldexp(wide, -e)
    e = e + ((m.abs() >= 1).to(torch.int32) - (m.abs() < 0.5).to(torch.int32)) * (~special).to(torch.int32)
    return torch.where(special, wide, _ldexp(wide, -e)).to(x.dtype), e


def _cdist(x1, x2, p, compute_mode=None):
    """``cdist``: the p-norm of each pair's difference (a reduction over the broadcast
    differences, computed directly: eager's products for large Euclidean inputs
    (``compute_mode``) round otherwise, and validation judges them). Pairs times the
    width past CUMSUM_WORK, and p of 0 or inf (eager's NaN there is its own), stay ATen's."""
    if not x1.is_floating_point() or not 0 < p < math.inf or x1.shape[-2] * x2.shape[-2] * x1.shape[-1] * math.prod(
            torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])) > CUMSUM_WORK:
        return NotImplemented
    return torch.linalg.vector_norm(x1.unsqueeze(-2) - x2.unsqueeze(-3), p, dim=-1)


def _pdist(x, p=2.0):
    """``pdist``: each pair i < j of the rows' distance, in order (the pairs read from the
    square of distances, an indexed read)."""
    made = _cdist(x, x, p)
    if made is NotImplemented:
        return made
    n = x.shape[0]
    pairs = torch.tensor([i * n + j for i in range(n) for j in range(i + 1, n)], dtype=torch.int64, device=x.device)
    return made.reshape(-1)[pairs]


def _copy_of(view):
    """``<view>_copy``: the view, then a contiguous copy of it (no memory shared)."""
    def copy(x, *args, **kwargs):
        made = view(x, *args, **kwargs)
        if isinstance(made, (tuple, list)):
            return [m.clone(memory_format=torch.contiguous_format) for m in made]
        return made.clone(memory_format=torch.contiguous_format)
    return copy


ADDED = {
    aten.cumsum.default: _cumsum_as_row_sums,
    aten.cumprod.default: _cumprod_as_row_products,
    aten.cummax.default: _cummax, aten.cummin.default: _cummin, aten.logcumsumexp.default: _logcumsumexp,
    aten.convolution.default: _patches_as_product, aten.convolution_backward.default: _patches_backward,
    aten.flip.default: _flip_as_reads, aten.unfold.default: _unfold_as_reads,
    aten.argmax.default: _argmax, aten.argmin.default: _argmin,
    aten.max.dim: _max_with_index, aten.min.dim: _min_with_index,
    aten.max.default: _max_of_all, aten.min.default: _min_of_all,
    aten.avg_pool1d.default: _avg_pool_of(1), aten.avg_pool2d.default: _avg_pool_of(2),
    aten.avg_pool3d.default: _avg_pool_of(3),
    aten._adaptive_avg_pool2d.default: _adaptive_avg_pool, aten._adaptive_avg_pool3d.default: _adaptive_avg_pool,
    aten.adaptive_avg_pool1d.default: _adaptive_avg_pool,
    aten.max_pool2d_with_indices.default: _max_pool_with_indices_of(2),
    aten.max_pool3d_with_indices.default: _max_pool_with_indices_of(3),
    aten.adaptive_max_pool2d.default: _adaptive_max_pool, aten.adaptive_max_pool3d.default: _adaptive_max_pool,
    aten.permute_copy.default: _copy_of(torch.permute), aten.view_copy.default: _copy_of(torch.Tensor.view),
    aten.narrow_copy.default: _copy_of(torch.narrow), aten.unbind_copy.int: _copy_of(torch.unbind),
    aten.as_strided_copy.default: _copy_of(torch.as_strided),
    aten.index_put.default: _index_put_at_many, aten.index_put_.default: _index_put_in_place_at_many,
    aten.histc.default: _histc,
    aten.scatter.src: _scatter_many, aten.scatter.value: _scatter_many,
    aten.scatter.reduce: _scatter_reducing, aten.scatter.value_reduce: _scatter_reducing,
    aten.scatter_add.default: _scatter_add, aten.scatter_reduce.two: _scatter_reduce,
    aten.index_reduce.default: _index_reduce, aten.put.default: _put, aten.masked_scatter.default: _masked_scatter,
    aten.round.decimals: _round_decimals, aten.angle.default: _angle, aten.addbmm.default: _addbmm,
    aten.dist.default: _dist, aten.ldexp.Tensor: _ldexp, aten.frexp.Tensor: _frexp,
    aten.pow.Tensor_Tensor: _pow_tensors,
    aten._cdist_forward.default: _cdist, aten._pdist_forward.default: _pdist,
    aten.diagonal_scatter.default: _diagonal_scatter, aten.as_strided_scatter.default: _as_strided_scatter,
    aten.topk.default: _topk,
    aten.sort.default: _sort, aten.sort.stable: _sort_stable, aten.kthvalue.default: _kthvalue,
    aten.median.default: _median, aten.median.dim: _median_dim,
    aten.nanmedian.default: _nanmedian, aten.nanmedian.dim: _nanmedian_dim,
}
