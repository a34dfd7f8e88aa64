"""The set-up as every engine reports it: the user's set-up with what resolving it decided (the model's name, the
layout, the GPU, the attention kernel that runs) and the facts the numbers depend on. One record, filled one way
(llmem.model.resolved.ResolvedSetup.record), in every MemoryResult."""

from __future__ import annotations

from dataclasses import dataclass

from llmem.setup.training import TrainingSetup


@dataclass(frozen=True)
class SetupRecord:
    setup: TrainingSetup       # as resolved: model name, method, gpus, gpus_per_node, tp, gpu and attn as they run
    model_type: str
    total_params: int
    trainable_params: int
    dp: int
    nodes: int
    gpu_memory_bytes: int
    cuda_context_bytes: int

    def __getattr__(self, name: str):
        # the set-up's own fields read through the record (record.model, record.batch_size, ...)
        if name == "setup":
            raise AttributeError(name)
        return getattr(self.setup, name)

    def to_dict(self) -> dict:
        out = self.setup.to_dict()
        out.update(model_type=self.model_type, total_params=self.total_params,
                   trainable_params=self.trainable_params, dp=self.dp, nodes=self.nodes,
                   gpu_memory_bytes=self.gpu_memory_bytes, cuda_context_bytes=self.cuda_context_bytes)
        return out
