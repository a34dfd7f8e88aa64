"""The set-up resolved once against its model: the trained anatomy, the GPU, the layout (with its method's row) and
the dtype regime, checked for support. Every engine starts from one; the planner hands `resolve` the layout it
resolved for each candidate (its values written into the set-up once, `TrainingSetup.with_layout`), which is not
resolved again, and derives the shapes it searches from one (`with_shape`) without resolving again."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from llmem.model.adapter_params import is_adapter_param
from llmem.model.anatomy import ModelAnatomy, setup_anatomy
from llmem.model.families import flash_refusal_of, tp_refusal_of, tp_style_refusal
from llmem.model.moe import moe_facts
from llmem.model.peft import trained_anatomy
from llmem.model.sharding import is_saved_copy
from llmem.model.vision import frozen_parts, with_parts_frozen
from llmem.model.vision_inputs import check_vision
from llmem.setup.expert_parallel import check_ep_model
from llmem.setup.gpus import GpuSpec, resolve_gpu
from llmem.setup.layout import Layout, check_heads, resolve_layout
from llmem.setup.methods import METHODS, MethodSpec, canonical_method
from llmem.setup.optimizers import OptimizerSpec
from llmem.setup.pipeline import check_pipeline
from llmem.setup.precision import Regime, regime_for
from llmem.setup.record import SetupRecord
from llmem.setup.support import ModelSupport, check_support
from llmem.setup.training import TrainingSetup

DEEPSPEED_METHODS = frozenset(m.name for m in METHODS.values() if m.zero_stage is not None)


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

    def record(self) -> SetupRecord:
        return setup_record(self.setup, self.anatomy, self.layout, self.gpu)


def resolve(setup: TrainingSetup, anatomy: ModelAnatomy | None = None, gpu: GpuSpec | None = None,
            layout: Layout | None = None) -> ResolvedSetup:
    """Resolve `setup`: its model (or `anatomy`, the base model's), its adapters, its GPU (or `gpu`), its layout,
    and the support check of its options under the method (LlmemError names the first problem). `layout`: the
    layout the caller resolved already (the planner's candidates, llmem.setup.layout.candidate_layouts, whose
    values `setup` holds: TrainingSetup.with_layout), taken as it is; its model's checks (heads, pipeline stages,
    experts) and the support check made on it. None: resolved from the set-up's fields."""
    if anatomy is None:
        check_without_model(setup)
    base = anatomy or setup_anatomy(setup)
    check_vision(setup, base)
    setup = engine_cast(setup)
    trained = with_parts_frozen(trained_anatomy(base, setup), frozen_parts(setup))
    gpu = gpu or resolve_gpu(setup.gpu, setup.gpu_memory, setup.cuda_context)
    if layout is None:
        layout = fields_layout(setup, trained)
    else:       # resolved without the trained model's heads where the planner's engine was the paper's
        check_heads(layout.tp, trained.num_heads, trained.num_kv_heads)
    check_pipeline(setup.pp, setup.pp_schedule, setup.microbatches, setup.batch_size, trained.num_layers,
                   setup.pp_virtual_stages)
    if layout.ep > 1:   # torchtitan's EP: the experts Shard(0) over ep of the FSDP2 ranks (llmem.setup.expert_parallel)
        facts = moe_facts(trained)
        check_ep_model(layout.ep, facts.experts if facts else None, layout.shard_degree)
    check_support(setup, layout.spec, model_support(trained))
    return ResolvedSetup(setup, trained, base, gpu, layout)


def fields_layout(setup: TrainingSetup, trained: ModelAnatomy) -> Layout:
    """The layout a set-up's own fields ask for (the command line's, the API's), its tp checked against the
    trained model's heads: --ep's degree set once the rest is resolved (resolve checks it against the experts)."""
    layout = resolve_layout(setup.method, setup.gpus, setup.tp, setup.gpus_per_node,
                            trained.num_heads, trained.num_kv_heads, setup.dp_replicate, setup.pp, setup.cp)
    return replace(layout, ep=setup.ep) if setup.ep > 1 else layout


def check_without_model(setup: TrainingSetup) -> None:
    """What the GPU and the layout refuse whatever the model (a GPU not in the catalog, --gpus 0, a tp that does not
    divide the GPUs), checked before the model is loaded: a refusal answers without importing torch or transformers
    for a model that must be built. The heads are checked in `resolve` (resolve_layout skips them at 0)."""
    resolve_gpu(setup.gpu, setup.gpu_memory, setup.cuda_context)
    resolve_layout(setup.method, setup.gpus, setup.tp, setup.gpus_per_node, 0, 0, setup.dp_replicate, setup.pp,
                   setup.cp)


def engine_cast(setup: TrainingSetup) -> TrainingSetup:
    """DeepSpeed's engine casts the whole module to its bf16 / fp16 (engine.py _configure_distributed_model), so
    peft's fp32 adapters run in the compute dtype there: adapter_dtype "base"."""
    if canonical_method(setup.method) in DEEPSPEED_METHODS and setup.mixed and setup.adapter_dtype == "fp32":
        return replace(setup, adapter_dtype="base")
    return setup


def model_support(anatomy: ModelAnatomy) -> ModelSupport:
    """What `anatomy` (the trained one) can run, from its transformers class's flags and its family's row."""
    head = next((p.name.split(".", 1)[0] for p in anatomy.params
                 if p.name.startswith("lm_head.") and is_adapter_param(p.name)), None)
    return ModelSupport(anatomy.architecture, anatomy.model_type, anatomy.supports_sdpa, anatomy.supports_flash_attn,
                        tp_refusal_of(anatomy.model_type), head,
                        tuple(tp_style_refusal(anatomy.model_type).items()),
                        flash_refusal=flash_refusal_of(anatomy.model_type),
                        tied_embeddings=anatomy.tie_word_embeddings,
                        peft_type=anatomy.peft.peft_type if anatomy.peft is not None else "",
                        peft_hand_modelled=anatomy.peft is not None and anatomy.peft.exact
                        and not anatomy.peft.num_virtual_tokens)


def setup_record(setup: TrainingSetup, anatomy: ModelAnatomy, layout: Layout, gpu: GpuSpec) -> SetupRecord:
    """The record of `setup` as it runs: `anatomy` (the trained one) under `layout` on `gpu`. Models without an
    SDPA implementation in transformers run eager attention. The adapters are read from the trained anatomy (what
    peft builds), not from the options: their kind, rank and the modules they adapt."""
    resolved = replace(setup, model=anatomy.name, parallelism=setup.parallelism.recorded(layout), gpu=gpu.name,
                       attn=setup.attn if anatomy.supports_sdpa else setup.attention_spec.without_sdpa)
    kind, rank, targets, saved, virtual = _adapters(anatomy, setup)
    return SetupRecord(resolved, anatomy.model_type, anatomy.total_params, anatomy.trainable_params, layout.dp,
                       layout.nodes, gpu.memory_bytes, gpu.cuda_context_bytes, layout=layout.label, adapter=kind,
                       adapter_rank=rank, adapter_targets=targets, saved_modules=saved, virtual_tokens=virtual,
                       attn_requested=setup.attn)


_PEFT_KINDS = {"LORA": "LoRA", "IA3": "IA3", "PROMPT_TUNING": "prompt tuning", "PREFIX_TUNING": "prefix tuning",
               "P_TUNING": "p-tuning", "ADALORA": "AdaLoRA", "LOHA": "LoHa", "LOKR": "LoKr", "BOFT": "BOFT",
               "OFT": "OFT", "VERA": "VeRA"}


def _adapters(anatomy: ModelAnatomy, setup: TrainingSetup
              ) -> tuple[str, int, tuple[str, ...], tuple[str, ...], int]:
    """(kind, rank, adapted module names, modules_to_save's names, virtual tokens) of the trained anatomy's peft
    adapters; ("", 0, (), (), 0) for full fine-tuning."""
    info = anatomy.peft
    if info is None:
        return "", 0, (), (), 0
    kind = "DoRA" if info.use_dora else _PEFT_KINDS.get(info.peft_type, info.peft_type)
    if kind == "LoRA":
        kind = setup.quant_spec.adapter_kind      # QLoRA on a 4-bit NF4 base
    rank, targets, saved = 0, [], []
    for p in anatomy.params:
        parts = p.name.split(".")
        if not p.trainable or "default" not in parts:
            continue
        at = parts.index("default")        # peft's adapter name: <module>.<adapter part>.default[.weight]
        # peft's ModulesToSaveWrapper: <module>.modules_to_save.default.*, a whole trained copy, not an adapter
        names = saved if is_saved_copy(p) else targets
        if at >= 2 and parts[at - 2] not in names:
            names.append(parts[at - 2])
        if not rank and parts[at - 1] == "lora_A" and len(p.shape) == 2:
            rank = p.shape[0]
    return kind, rank, tuple(targets), tuple(saved), info.num_virtual_tokens


def assemble(setup: TrainingSetup, base: ModelAnatomy, gpu: GpuSpec, layout: Layout) -> ResolvedSetup:
    """A resolved set-up from parts already checked elsewhere (no layout or support check): for arithmetic on a
    layout an engine chose, e.g. the paper engine's 1D TP, which splits weights and not heads."""
    return ResolvedSetup(setup, trained_anatomy(base, setup), base, gpu, layout)
