"""The decompositions eqfuse adds to torch's, for ops its kernels compute in other terms:
each takes the op's arguments and returns its result in ops eqfuse has kernel forms for,
or NotImplemented where it does not apply (the op then stays itself, an eager step with
its reason). ``ADDED`` maps each op to its decomposition (frontend/capture.py puts them
in the table it traces with)."""

from __future__ import annotations

import torch

from .arithmetic import _addbmm, _angle, _cdist, _dist, _frexp, _ldexp, _pdist, _pow_tensors, _round_decimals
from .orderings import (
    _argmax,
    _argmin,
    _kthvalue,
    _max_of_all,
    _max_with_index,
    _median,
    _median_dim,
    _min_of_all,
    _min_with_index,
    _nanmedian,
    _nanmedian_dim,
    _sort,
    _sort_stable,
    _topk,
)
from .reads import _copy_of, _flip_as_reads, _unfold_as_reads
from .scans import _cummax, _cummin, _cumprod_as_row_products, _logcumsumexp, cumsum_as_row_sums
from .scatters import (
    _as_strided_scatter,
    _diagonal_scatter,
    _histc,
    _index_put_at_many,
    _index_put_in_place_at_many,
    _index_reduce,
    _masked_scatter,
    _put,
    _scatter_add,
    _scatter_many,
    _scatter_reduce,
    _scatter_reducing,
)
from .windows import (
    _adaptive_avg_pool,
    _adaptive_max_pool,
    _avg_pool_of,
    _max_pool_with_indices_of,
    _patches_as_product,
    _patches_backward,
)

aten = torch.ops.aten


ADDED = {
    aten.cumsum.default: cumsum_as_row_sums,
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
