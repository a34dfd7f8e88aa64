"""`dense.sparse_mask(mask)` on fake tensors: torch's fake kernel returns a sparse tensor with no entries, so a
backward through a sparse COO constructor fails (SparseCooTensorWithDimsAndTensorsBackward0's values gradient,
`sparse_mask(...)._values()`, is [0] where [nnz] is expected). SHiRA's forward adds such a tensor to the cloned base
weight (peft/tuners/shira/layer.py `get_delta_weight`). On CUDA (aten/src/ATen/native/sparse/SparseTensor.cpp
`sparse_mask`) the result takes the mask's indices and allocates its values, [nnz, dense dims] in the dense
tensor's dtype: made so here, through the mode's own dispatch (the values are a tracked allocation).

`sparse.coalesce()` alike: torch's fake `_coalesce` returns no entries (the count of distinct positions is the
values'); FRoD builds its sparse S from distinct positions (peft/tuners/frod/model.py: a randperm of the off-diagonal
ones) and coalesces it every forward (frod/layer.py `_get_frod_tensors`). On CUDA (aten/src/ATen/native/sparse/cuda/
SparseCUDATensor.cu `_coalesce_sparse_cuda`) the result's indices and values are allocated for the input's nnz
whatever the distinct count: made so here, the input's entries kept."""

from __future__ import annotations

import torch

_aten = torch.ops.aten
SPARSE_MASK = _aten.sparse_mask.default
COALESCE = _aten._coalesce.default


def fake_sparse_mask(dispatch, types, dense: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sparse_mask's result with the mask's nnz (`dispatch`: the fake mode's __torch_dispatch__)."""
    # (a sparse `dense`: the gradient reaching a coalesce's input, aten's sparse_mask of two sparse tensors)
    like = dense._values() if dense.layout == torch.sparse_coo else dense
    values = dispatch(_aten.new_empty.default, types, (like, [mask._nnz(), *mask.shape[mask.sparse_dim():]]), {})
    return dispatch(_aten._sparse_coo_tensor_with_dims_and_tensors.default, types,
                    (mask.sparse_dim(), mask.dense_dim(), list(mask.shape), mask._indices(), values),
                    dict(dtype=dense.dtype, layout=torch.sparse_coo, device=dense.device,
                         is_coalesced=mask.is_coalesced()))


def fake_coalesce(dispatch, types, sparse: torch.Tensor) -> torch.Tensor:
    """_coalesce's result with the input's nnz (`dispatch`: the fake mode's __torch_dispatch__)."""
    indices = dispatch(_aten.clone.default, types, (sparse._indices(),), {})
    values = dispatch(_aten.clone.default, types, (sparse._values(),), {})
    return dispatch(_aten._sparse_coo_tensor_with_dims_and_tensors.default, types,
                    (sparse.sparse_dim(), sparse.dense_dim(), list(sparse.shape), indices, values),
                    dict(dtype=sparse.dtype, layout=torch.sparse_coo, device=sparse.device, is_coalesced=True))
