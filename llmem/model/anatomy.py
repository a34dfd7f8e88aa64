"""Model anatomy: the model's real structure, built on the meta device from its HF config.

Every parameter is inventoried (name, shape, dtype, module kind, layer index, tied, trainable) together with the
dimensions that activations depend on. Nothing is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from math import prod

from llmem.model.config import build_meta_model, resolve_config
from llmem.model.families import decoder_layers, dimensions, family_of


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str
    module_kind: str          # class name of the owning module: Linear, Embedding, LayerNorm, Conv1D, ...
    layer_index: int | None   # decoder layer, None for embeddings / final norm / lm_head
    tied_to: str | None       # name of the parameter this one shares storage with (the first name seen)
    trainable: bool = True

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def in_features(self) -> int:
        """A matmul weight's input features: nn.Linear stores [out, in], GPT-2's Conv1D [in, out]."""
        return self.shape[0] if self.module_kind == "Conv1D" else self.shape[1]

    @property
    def out_features(self) -> int:
        return self.shape[1] if self.module_kind == "Conv1D" else self.shape[0]


@dataclass(frozen=True)
class PeftInfo:
    """What peft adds that activations depend on (the trainable set itself is in the anatomy's params)."""
    peft_type: str                      # peft's PeftType: LORA, IA3, PROMPT_TUNING, PREFIX_TUNING, ...
    lora_dropout: float = 0.0           # LoRA: nn.Dropout(p) on each adapter's input
    use_dora: bool = False              # LoRA: DoRA's magnitude vectors and per-forward weight norms
    num_virtual_tokens: int = 0         # prompt tuning: prepended embeddings (the model runs seq_len + n)
    exact: bool = True                  # False: activations modelled as for the frozen base (a note says so)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelAnatomy:
    name: str
    model_type: str
    architecture: str
    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    params: tuple[ParamInfo, ...]          # unique parameters only (a tied weight appears once)
    tied_names: tuple[str, ...] = ()       # names that alias an earlier parameter
    supports_sdpa: bool = True             # HF class accepts attn_implementation="sdpa" (else eager runs)
    supports_flash_attn: bool = True       # HF class's _supports_flash_attn (attn_implementation="flash_attention_2")
    config: dict = field(default_factory=dict, compare=False, hash=False)
    peft: PeftInfo | None = None           # set when peft adapters / prompts are part of the model
    decoder_layer_class: str = ""          # class name of one decoder layer (FSDP's wrapping unit)
    max_positions: int | None = None       # config's max_position_embeddings (None: not stated)
    varied_layers: tuple[str, ...] = ()    # sizes that differ between layers (gemma4, dots3, gemma3n): the largest read

    @cached_property
    def total_params(self) -> int:
        """(summed once: every schedule and time model of a plan reads it)"""
        return sum(p.numel for p in self.params)

    @cached_property
    def trainable_params(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)

    def layer_params(self, index: int) -> int:
        return self.params_per_layer[index] if 0 <= index < self.num_layers else 0

    @cached_property
    def params_per_layer(self) -> tuple[int, ...]:
        """Parameters of each decoder layer (summed once: the planner's time model reads them per layout)."""
        per = [0] * self.num_layers
        for p in self.params:
            if p.layer_index is not None and 0 <= p.layer_index < self.num_layers:
                per[p.layer_index] += p.numel
        return tuple(per)

    @cached_property
    def matmul_params(self) -> tuple[float, float]:
        """(decoder-layer, other) weights that multiply activations, per token (the time model's FLOPs); MoE experts
        scaled to the active ones (summed once: the planner asks it hundreds of times a plan)."""
        cfg = self.config or {}
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        active = cfg.get("num_experts_per_tok") or 0
        expert_share = active / experts if experts and active else 1.0
        layer = other = 0.0
        for p in self.params:
            if len(p.shape) < 2 or p.module_kind.endswith("Embedding"):
                continue
            n = float(p.numel)
            if ".experts." in p.name or "Experts" in p.module_kind:
                n *= expert_share
            if p.layer_index is not None:
                layer += n
            elif not p.name.startswith("lm_head"):
                other += n
        other += self.vocab_size * self.hidden_size          # the lm_head matmul, tied or not
        return layer, other

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, final norm, lm_head (FSDP's root unit)."""
        return sum(p.numel for p in self.params if p.layer_index is None)

    @property
    def largest_layer_params(self) -> int:
        return max((self.layer_params(i) for i in range(self.num_layers)), default=0)

    @property
    def embedding_params(self) -> int:
        return sum(p.numel for p in self.params if p.module_kind.endswith("Embedding") and p.layer_index is None)

    def params_of_kind(self, *kinds: str) -> list[ParamInfo]:
        return [p for p in self.params if p.module_kind in kinds]

    @property
    def varied_layers_note(self) -> str | None:
        """What the activations assume of a model whose layers differ in size (its parameters are counted exactly)."""
        if not self.varied_layers:
            return None
        return (f"{self.model_type}'s decoder layers differ in {', '.join(self.varied_layers)}: activations are "
                "modelled with the largest layer's sizes for every layer (parameters are counted layer by layer)")

    def positions_note(self, seq_len: int) -> str | None:
        """The note a result carries when the model runs more tokens than its config's max_position_embeddings (one
        text for the estimate and the real step): memory is estimated all the same, quality is not promised."""
        tokens = seq_len + (self.peft.num_virtual_tokens if self.peft is not None else 0)
        if self.max_positions is None or tokens <= self.max_positions:
            return None
        return (f"{tokens} tokens per sample exceed {self.name}'s max_position_embeddings ({self.max_positions}): "
                "memory is estimated as asked, but the model was not trained for sequences this long (learned "
                "position tables such as GPT-2's have no rows beyond it)")


def _layer_index(name: str, prefix: str) -> int | None:
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _first_names(model) -> dict[int, str]:
    """id(parameter) -> the first name it is reachable by (tied parameters have more)."""
    seen: dict[int, str] = {}
    for module_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            seen.setdefault(id(p), f"{module_name}.{pname}" if module_name else pname)
    return seen


def inventory(model, name: str) -> ModelAnatomy:
    """Walk the built module tree and record every parameter once."""
    cfg = model.config
    layers = decoder_layers(model)
    layers_prefix = (layers[0] if layers else "") + "."
    seen = _first_names(model)
    params: list[ParamInfo] = []
    tied: list[str] = []
    tied_targets: dict[str, str] = {}     # the first name of a tied pair -> the other name, so both sides know
    for module_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            if seen[id(p)] != full:
                tied.append(full)
                tied_targets[seen[id(p)]] = full
                continue
            params.append(ParamInfo(full, tuple(p.shape), str(p.dtype).replace("torch.", ""),
                                    type(module).__name__, _layer_index(full, layers_prefix), None))
    params = [ParamInfo(p.name, p.shape, p.dtype, p.module_kind, p.layer_index, tied_targets.get(p.name))
              for p in params]
    dims = dimensions(cfg)
    return ModelAnatomy(
        name=name, model_type=cfg.model_type, architecture=type(model).__name__,
        family=family_of(cfg.model_type).family, tie_word_embeddings=bool(tied), params=tuple(params),
        tied_names=tuple(tied), supports_sdpa=bool(getattr(type(model), "_supports_sdpa", False)),
        supports_flash_attn=bool(getattr(type(model), "_supports_flash_attn", False)),
        config=cfg.to_dict(), decoder_layer_class=type(layers[1][0]).__name__ if layers else "", **dims)


@lru_cache(maxsize=64)
def load_anatomy(model: str, trust_remote_code: bool = False, scalar_head: bool = False) -> ModelAnatomy:
    """MODEL string -> its anatomy (cached: anatomies are immutable); scalar_head: as a reward model (num_labels=1)."""
    name, cfg = resolve_config(model, trust_remote_code)
    return inventory(build_meta_model(cfg, trust_remote_code, scalar_head), name)


def setup_anatomy(setup) -> ModelAnatomy:
    """The anatomy of the model `setup` trains: its causal LM, or the sequence-classification model TRL's
    RewardTrainer builds from it (--objective reward)."""
    from llmem.setup.objectives import objective_spec

    return load_anatomy(setup.model, setup.trust_remote_code, objective_spec(setup.objective).scalar_head)
