"""The set-up resolved once against its model: the trained anatomy, the GPU, the layout (with its method's row) and
the dtype regime, checked for support. Every engine starts from one; the planner derives the variants it searches
from one (`with_shape`, `with_layout`) without resolving again."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from llmem.model.anatomy import ModelAnatomy, load_anatomy
from llmem.model.peft import trained_anatomy
from llmem.setup.gpus import GpuSpec, resolve_gpu
from llmem.setup.layout import Layout, resolve_layout
from llmem.setup.methods import TP_NONE, MethodSpec
from llmem.setup.optimizers import OptimizerSpec
from llmem.setup.precision import Regime, regime_for
from llmem.setup.record import SetupRecord
from llmem.setup.support import check_support
from llmem.setup.training import TrainingSetup


@dataclass(frozen=True)
class ResolvedSetup:
    setup: TrainingSetup
    anatomy: ModelAnatomy      # as trained: adapters added, the base frozen
    base: ModelAnatomy         # the model as published
    gpu: GpuSpec
    layout: Layout

    @property
    def method(self) -> MethodSpec:
        return self.layout.spec

    @property
    def optimizer(self) -> OptimizerSpec:
        return self.setup.optimizer_spec

    @cached_property
    def regime(self) -> Regime:
        return regime_for(self.setup, self.method)

    def with_shape(self, batch_size: int, seq_len: int | None = None) -> ResolvedSetup:
        """The same set-up at another micro-batch shape (nothing else is resolved again)."""
        setup = replace(self.setup, batch_size=batch_size,
                        seq_len=self.setup.seq_len if seq_len is None else seq_len)
        return ResolvedSetup(setup, self.anatomy, self.base, self.gpu, self.layout)

    def with_layout(self, layout: Layout, batch_size: int | None = None) -> ResolvedSetup:
        """The same set-up under another layout of the same model and GPU (support checked for it)."""
        setup = setup_for(self.setup, layout, self.setup.batch_size if batch_size is None else batch_size)
        check_support(setup, layout.spec)
        return ResolvedSetup(setup, self.anatomy, self.base, self.gpu, layout)

    def record(self) -> SetupRecord:
        return setup_record(self.setup, self.anatomy, self.layout, self.gpu)


def setup_for(base: TrainingSetup, layout: Layout, batch_size: int) -> TrainingSetup:
    """`base` run with `layout` at micro-batch `batch_size` (the fields a layout decides)."""
    return replace(base, method=layout.method, gpus=layout.world_size,
                   tp=layout.tp if layout.spec.tensor_parallel != TP_NONE else None, batch_size=batch_size)


def resolve(setup: TrainingSetup, anatomy: ModelAnatomy | None = None, gpu: GpuSpec | None = None) -> ResolvedSetup:
    """Resolve `setup`: its model (or `anatomy`, the base model's), its adapters, its GPU (or `gpu`), its layout,
    and the support check of its options under the method (LlmemError names the first problem)."""
    base = anatomy or load_anatomy(setup.model, setup.trust_remote_code)
    trained = trained_anatomy(base, setup)
    gpu = gpu or resolve_gpu(setup.gpu, setup.gpu_memory, setup.cuda_context)
    layout = resolve_layout(setup.method, setup.gpus, setup.tp, setup.gpus_per_node,
                            trained.num_heads, trained.num_kv_heads)
    check_support(setup, layout.spec)
    return ResolvedSetup(setup, trained, base, gpu, layout)


def setup_record(setup: TrainingSetup, anatomy: ModelAnatomy, layout: Layout, gpu: GpuSpec) -> SetupRecord:
    """The record of `setup` as it runs: `anatomy` (the trained one) under `layout` on `gpu`. Models without an
    SDPA implementation in transformers run eager attention."""
    resolved = replace(setup, model=anatomy.name, method=layout.method, tp=layout.tp, gpus=layout.world_size,
                       gpus_per_node=layout.gpus_per_node, gpu=gpu.name,
                       attn=setup.attn if anatomy.supports_sdpa else "eager")
    return SetupRecord(resolved, anatomy.model_type, anatomy.total_params, anatomy.trainable_params, layout.dp,
                       layout.nodes, gpu.memory_bytes, gpu.cuda_context_bytes)


def assemble(setup: TrainingSetup, base: ModelAnatomy, gpu: GpuSpec, layout: Layout) -> ResolvedSetup:
    """A resolved set-up from parts already checked elsewhere (no layout or support check): for arithmetic on a
    layout an engine chose, e.g. the paper engine's 1D TP, which splits weights and not heads."""
    return ResolvedSetup(setup, trained_anatomy(base, setup), base, gpu, layout)
