"""A sharded checkpoint read by torch.distributed.checkpoint's real load on fake tensors: a StorageReader whose
metadata is the state dict's own (each tensor saved as the world's dim-0 chunks, FSDP2's shards, as a run of the
same world saved them) and whose reads are host tensors of each stored chunk's shape, as FileSystemReader.read_data
makes them (torch/distributed/checkpoint/filesystem.py: torch.load of the chunk into host memory,
narrow_tensor_by_index, then `target.copy_(tensor)` and commit_tensor, one read item at a time)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from math import ceil

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from llmem.runtime.patches import patched


def dim0_chunks(size: torch.Size, world: int) -> list[ChunkStorageMetadata]:
    """torch.chunk's split of dim 0 over `world` ranks (FSDP2's Shard(0)): the non-empty chunks."""
    if not size:
        return [ChunkStorageMetadata(offsets=torch.Size(()), sizes=torch.Size(()))]
    rows = ceil(size[0] / world)
    return [ChunkStorageMetadata(offsets=torch.Size((r, *[0] * (len(size) - 1))),
                                 sizes=torch.Size((min(rows, size[0] - r), *size[1:])))
            for r in range(0, size[0], rows)]


def checkpoint_metadata(state_dict: dict, world: int) -> Metadata:
    """The checkpoint's metadata: every tensor of `state_dict` (global shapes, dtypes) in dim-0 chunks."""
    return Metadata(state_dict_metadata={
        fqn: TensorStorageMetadata(properties=TensorProperties(dtype=t.dtype), size=t.shape,
                                   chunks=dim0_chunks(t.shape, world))
        for fqn, t in state_dict.items() if isinstance(t, torch.Tensor)})


class FakeChunkReader(StorageReader):
    """The checkpoint's chunks as host tensors of their shapes (module docstring)."""

    def __init__(self, metadata: Metadata) -> None:
        super().__init__()
        self.metadata = metadata

    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def _chunk(self, index: MetadataIndex) -> tuple[ChunkStorageMetadata, torch.dtype]:
        md = self.metadata.state_dict_metadata[index.fqn]
        return next(c for c in md.chunks if c.offsets == index.offset), md.properties.dtype

    def read_data(self, plan, planner):
        from torch.distributed.checkpoint.planner import LoadItemType
        from torch.futures import Future

        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                continue
            chunk, dtype = self._chunk(req.storage_index)
            stored = torch.empty(chunk.sizes, dtype=dtype, device="cpu")      # torch.load's host tensor
            tensor = _narrow(stored, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            target.copy_(tensor)
            planner.commit_tensor(req, target)
            del stored, tensor, target
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """FileSystemReader's narrow_tensor_by_index (torch/distributed/_shard/_utils.py)."""
    from torch.distributed._shard._utils import narrow_tensor_by_index

    return narrow_tensor_by_index(tensor, offsets, lengths)


@contextlib.contextmanager
def _offsets_outside_fake() -> Iterator[None]:
    """The planner's chunk offsets (compute_local_shape_and_global_offset: index tensors read back as ints) worked
    out on real host tensors, as DeviceMesh's bookkeeping is (llmem.runtime.distributed.device_mesh_outside_fake)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.checkpoint import planner_helpers

    offsets = planner_helpers.compute_local_shape_and_global_offset

    def outside(*args, **kwargs):
        with unset_fake_temporarily():
            return offsets(*args, **kwargs)

    with patched(planner_helpers, "compute_local_shape_and_global_offset", outside):
        yield


def load_sharded(state_dict: dict) -> None:
    """torch.distributed.checkpoint.load of `state_dict` (its tensors this rank's shards) from the fake checkpoint
    (no_dist: the plans are this rank's own; the fake process group carries no objects)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    reader = FakeChunkReader(checkpoint_metadata(state_dict, dist.get_world_size()))
    with _offsets_outside_fake():
        dcp.load(state_dict, storage_reader=reader, no_dist=True)
