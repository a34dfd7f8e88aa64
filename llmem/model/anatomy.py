"""Model anatomy: the model's real structure, built on the meta device from its HF config.

Every parameter is inventoried (name, shape, dtype, module kind, layer index, tied, trainable) together with the
dimensions that activations depend on. Nothing is allocated.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property, lru_cache
from math import prod

from llmem.model import anatomy_cache as disk
from llmem.model.anatomy_cache import ANATOMY_FORMAT
from llmem.model.config import build_meta_model, config_source, resolve_config
from llmem.model.exact_json import same, tagged, untagged
from llmem.model.families import decoder_layers, dimensions, family_of

# torch's element sizes by dtype name (torch.dtype.itemsize), for tensors kept in their own dtype
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1}


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

    @cached_property
    def kind(self) -> tuple:
        """What the per-parameter facts read (llmem.model.sharding, .peft, llmem.memory.quant: its module's and leaf's
        names, shape, dtype, module kind, whether it is in a decoder layer, tying, trainability), its decoder
        layer's index aside: the parameters of identical layers share it, so a fact is worked out once per kind."""
        name = self.name if self.layer_index is None else self.name.replace(f".{self.layer_index}.", ".#.", 1)
        return name, self.shape, self.dtype, self.module_kind, self.layer_index is None, self.tied_to, self.trainable

    @property
    def own_bytes(self) -> int:
        """Bytes of the tensor in its own dtype (a buffer's, kept as its module made it)."""
        return self.numel * DTYPE_BYTES[self.dtype]

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
    # tensors an adapter registers as buffers (OSF's frozen SVD factors), as frozen ParamInfo rows: on the device
    # beside the weights and never sharded (FSDP2 and ZeRO shard parameters only); the base model's own buffers
    # (rotary inv_freq) are below what the estimate counts and are not listed
    buffers: tuple[ParamInfo, ...] = ()
    # frozen parameters an adapter keeps on the host while training (FRoD's runtime_offload_base_weight: the base
    # weights of the modules it adapts, llmem.model.peft.host_offloaded_weights): part of the model, not of the
    # device's memory (the rows are not in `params`)
    host_params: tuple[ParamInfo, ...] = ()

    @cached_property
    def total_params(self) -> int:
        """(summed once: every schedule and time model of a plan reads it)"""
        return sum(p.numel for p in self.params) + sum(p.numel for p in self.host_params)

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

    @cached_property
    def layer0_params(self) -> tuple[ParamInfo, ...]:
        """Decoder layer 0's parameters (the activation recipes and moments price layer 0 for every layer; picked
        once: a plan asks hundreds of times)."""
        return tuple(p for p in self.params if p.layer_index == 0)

    @cached_property
    def outside_layer_params(self) -> tuple[ParamInfo, ...]:
        """The parameters outside the decoder layers (embeddings, final norm, lm_head, a VLM's tower), picked once."""
        return tuple(p for p in self.params if p.layer_index is None)

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


def added_buffers(model, before: set[int], extra: Sequence[tuple] = ()) -> tuple[ParamInfo, ...]:
    """The buffers of `model` (the built model, peft's layers in it) that are not among `before` (ids of the buffers
    it had before the adapter was applied), as frozen ParamInfo rows: what an adapter registers (OSF's SVD
    factors); then `extra` (name, tensor, its module's class name): tensors the adapter holds outside its buffers that the step keeps on the
    device as one (llmem.model.peft.host_index_tensors)."""
    layers = decoder_layers(model)
    prefix = (layers[0] if layers else "") + "."
    out: list[ParamInfo] = [ParamInfo(full, tuple(t.shape), str(t.dtype).replace("torch.", ""), kind,
                                      _layer_index(full, prefix), None, False) for full, t, kind in extra]
    for module_name, module in model.named_modules():
        for bname, b in module.named_buffers(recurse=False):
            if b is None or id(b) in before:
                continue
            before.add(id(b))
            full = f"{module_name}.{bname}" if module_name else bname
            out.append(ParamInfo(full, tuple(b.shape), str(b.dtype).replace("torch.", ""), type(module).__name__,
                                 _layer_index(full, prefix), None, False))
    return tuple(out)


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


# ---------------------------------------------------------------------------------- the anatomy as a file (no torch)
_PARAM_FIELDS = tuple(f.name for f in fields(ParamInfo))
_SCALAR_FIELDS = tuple(f.name for f in fields(ModelAnatomy)
                       if f.name not in ("params", "config", "peft", "buffers", "host_params"))


def anatomy_text(anatomy: ModelAnatomy, made_with: dict[str, str]) -> str:
    """The anatomy as JSON text (what the catalog ships and the disk cache keeps): the header, the config and each
    parameter ([name, shape, dtype, module kind, layer index, tied to, trainable]) on lines of their own, reviewable
    in a diff. `made_with`: what it was built from (the config's digest, the code's versions)."""
    head = {"format": ANATOMY_FORMAT, "made_with": made_with,
            **{name: tagged(getattr(anatomy, name)) for name in _SCALAR_FIELDS},
            "peft": None if anatomy.peft is None else {f.name: tagged(getattr(anatomy.peft, f.name))
                                                       for f in fields(PeftInfo)}}
    compact = {"separators": (",", ":")}
    def rows(params: tuple[ParamInfo, ...]) -> str:
        return ",\n".join(json.dumps([getattr(p, name) for name in _PARAM_FIELDS], **compact) for p in params)

    buffers = ['"buffers":[', rows(anatomy.buffers), "],"] if anatomy.buffers else []   # only where an adapter has any
    if anatomy.host_params:                                                             # ... and host parameters
        buffers += ['"host_params":[', rows(anatomy.host_params), "],"]
    return "\n".join([json.dumps(head, **compact)[:-1] + ",",
                      f'"config":{json.dumps(tagged(anatomy.config), **compact)},', *buffers, '"params":[',
                      rows(anatomy.params), "]}"]) + "\n"


def anatomy_from_text(text: str, made_with: dict[str, str] | None = None) -> ModelAnatomy:
    """The anatomy a text written by anatomy_text holds (ValueError, KeyError or TypeError when it holds none, or
    when its `made_with` lacks an item of `made_with`)."""
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("format") != ANATOMY_FORMAT:
        raise ValueError(f"not an anatomy of format {ANATOMY_FORMAT}")
    if made_with and any(data["made_with"].get(k) != v for k, v in made_with.items()):
        raise ValueError("made from another config")
    def rows(key: str) -> tuple[ParamInfo, ...]:
        return tuple(ParamInfo(**(dict(zip(_PARAM_FIELDS, row, strict=True)) | {"shape": tuple(row[1])}))
                     for row in data.get(key, ()))

    peft = data["peft"]
    return ModelAnatomy(**{name: untagged(data[name]) for name in _SCALAR_FIELDS}, params=rows("params"),
                        buffers=rows("buffers"), host_params=rows("host_params"), config=untagged(data["config"]),
                        peft=None if peft is None else PeftInfo(**{k: untagged(v) for k, v in peft.items()}))


def read_anatomy(text: str | None, made_with: dict[str, str] | None = None) -> ModelAnatomy | None:
    """anatomy_from_text, or None for a missing or corrupt text."""
    if text is None:
        return None
    try:
        return anatomy_from_text(text, made_with)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def exact_round_trip(anatomy: ModelAnatomy, text: str) -> bool:
    """Whether `text` gives back `anatomy` field for field, the config's types included."""
    back = read_anatomy(text)
    return back is not None and all(same(getattr(anatomy, f.name), getattr(back, f.name))
                                    for f in fields(ModelAnatomy))


def read_or_build(model: str, trust_remote_code: bool, build: Callable[[], ModelAnatomy], shipped: bool = True,
                  **variant: object) -> ModelAnatomy:
    """MODEL's anatomy as `variant` says: the catalog's shipped file (`shipped`: the plain causal LM) or the disk
    cache's when there is one (llmem.model.anatomy_cache), else `build()`, kept for the next process. A model's own
    code (trust_remote_code) is always built: its config does not pin it."""
    use = disk.anatomy_cache_on() and not trust_remote_code
    source = config_source(model) if use else None
    if source is not None:
        found = (read_anatomy(disk.shipped_text(source), {"config_sha256": disk.config_digest(source[1])})
                 if shipped and source[2] is not None else None)
        found = found or read_anatomy(disk.cached_text(disk.anatomy_key(source, **variant)))
        if found is not None:
            return found
    anatomy = build()
    if use and source is None:                           # a hub model's config is in the HF cache by now
        source = config_source(model)
    if source is not None and source[0] == anatomy.name:
        try:
            text = anatomy_text(anatomy, disk.code_versions())
        except (TypeError, ValueError):                  # a config value JSON cannot hold: not kept
            return anatomy
        if exact_round_trip(anatomy, text):
            disk.keep_text(disk.anatomy_key(source, **variant), text)
    return anatomy


@lru_cache(maxsize=64)
def load_anatomy(model: str, trust_remote_code: bool = False, scalar_head: bool = False) -> ModelAnatomy:
    """MODEL string -> its anatomy (cached: anatomies are immutable); scalar_head: as a reward model (num_labels=1).
    Read from a file when one holds it (read_or_build: no torch), else built from the real class."""

    def build() -> ModelAnatomy:
        name, cfg = resolve_config(model, trust_remote_code)
        return inventory(build_meta_model(cfg, trust_remote_code, scalar_head), name)

    return read_or_build(model, trust_remote_code, build, shipped=not scalar_head, scalar_head=scalar_head)


def setup_anatomy(setup) -> ModelAnatomy:
    """The anatomy of the model `setup` trains: its causal LM, or the sequence-classification model TRL's
    RewardTrainer builds from it (--objective reward)."""
    from llmem.setup.objectives import objective_spec

    return load_anatomy(setup.model, setup.trust_remote_code, objective_spec(setup.objective).scalar_head)
