"""The set-up floor: what the user asks about (TrainingSetup), the registries of its variants (methods,
optimizers, precisions, GPUs), the GPU layouts and the one support check. Nothing here knows a model."""

from llmem.setup.gpus import GPU_CATALOG, GpuSpec, resolve_gpu
from llmem.setup.layout import Layout, candidate_layouts, resolve_layout
from llmem.setup.methods import METHODS, MethodSpec, canonical_method
from llmem.setup.optimizers import OPTIMIZERS, OptimizerSpec
from llmem.setup.precision import PRECISIONS, Regime, regime_for
from llmem.setup.support import check_support
from llmem.setup.training import TrainingSetup, default_method

__all__ = ["GPU_CATALOG", "GpuSpec", "Layout", "METHODS", "MethodSpec", "OPTIMIZERS", "OptimizerSpec", "PRECISIONS",
           "Regime", "TrainingSetup", "candidate_layouts", "canonical_method", "check_support", "default_method",
           "regime_for", "resolve_gpu", "resolve_layout"]
