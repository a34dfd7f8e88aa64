"""`dense.sparse_mask(mask)` on fake tensors: torch's fake kernel returns a sparse tensor with no entries, so a
backward through a sparse COO constructor fails (SparseCooTensorWithDimsAndTensorsBackward0's values gradient,
`sparse_mask(...)._values()`, is [0] where [nnz] is expected). SHiRA's forward adds such a tensor to the cloned base
weight (peft/tuners/shira/layer.py `get_delta_weight`). On CUDA (aten/src/ATen/native/sparse/SparseTensor.cpp
`sparse_mask`) the result takes the mask's indices and allocates its values, [nnz, dense dims] in the dense
tensor's dtype: made so here, through the mode's own dispatch (the values are a tracked allocation)."""

from __future__ import annotations

import torch

_aten = torch.ops.aten
SPARSE_MASK = _aten.sparse_mask.default


def fake_sparse_mask(dispatch, types, dense: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sparse_mask's result with the mask's nnz (`dispatch`: the fake mode's __torch_dispatch__)."""
    values = dispatch(_aten.new_empty.default, types, (dense, [mask._nnz(), *mask.shape[mask.sparse_dim():]]), {})
    return dispatch(_aten._sparse_coo_tensor_with_dims_and_tensors.default, types,
                    (mask.sparse_dim(), mask.dense_dim(), list(mask.shape), mask._indices(), values),
                    dict(dtype=dense.dtype, layout=torch.sparse_coo, device=dense.device,
                         is_coalesced=mask.is_coalesced()))
