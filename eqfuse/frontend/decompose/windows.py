"""Windows: convolutions as products over the input's patches, pooling as reductions over
windows or tiles."""

from __future__ import annotations

import itertools
import math

import torch

aten = torch.ops.aten


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
