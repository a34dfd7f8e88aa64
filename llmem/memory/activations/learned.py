"""Activations learned from the real code, as the estimate consumes them: one decoder layer's blocks (what each keeps
for backward, its forward temporaries, the parameters it owns, its backward transient) with every size a polynomial
in the micro-batch b and the tokens per sample s, plus the embedding's, the head's and the shared tensors.

llmem.learn measures them (a shallow copy of the model run on fake tensors at a few b x s points, the
recorded allocations read back); this module holds the fitted result, evaluates it at the requested shape as a
`LayerRecipe` the schedule replays like a hand recipe, says when a set-up needs it (`learning_need`), and keeps it
per key (`learning_key`: the model's config and the set-up fields that change activations) in memory and on disk
($LLMEM_CACHE_DIR or ~/.cache/llmem, `learned/<hash>.json`). No torch here: reading the cache is plain JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from llmem.cache import CACHE_ENV, cache_root, code_versions  # noqa: F401 - CACHE_ENV: re-exported for tests
from llmem.memory.activations.blocks import Block, LayerRecipe
from llmem.memory.activations.learned_vision import LearnedVision
from llmem.memory.activations.selective import SelectiveLayer, hand_selective_refusal
from llmem.model.families import family_of
from llmem.model.peft import read_peft_config
from llmem.model.resolved import ResolvedSetup
from llmem.model.vision import cross_attention_layers, vision_spec
from llmem.setup.checkpointing import AC_POLICIES
from llmem.setup.objectives import objective_spec

# bump when what is learned, or how, changes: older cache files are not read (2: TRL's objectives, Liger's kernels
# and float8 linears in the key; a file learned under them was read for the plain step before. 3: a paired
# objective's sizes fitted per row, not per pair: read at the doubled batch, they counted each pair twice)
LEARN_FORMAT = 3
# The TrainingSetup fields learning_key reads (some through what they resolve to: the model's config, the dtype
# regime, the GPU's compute capability). Every other field is reset by the learning run
# (llmem.learn.shallow_copy.learning_setup) or changes nothing a decoder layer keeps (LAYER_FREE_FIELDS):
# tests/learn/test_learning_key.py holds every field to one of the three.
KEYED_FIELDS = ("model", "trust_remote_code", "method", "precision", "gpu", "lora_rank", "lora_alpha", "lora_targets",
                "lora_dropout", "peft_config", "adapter_dtype", "attn", "packing", "ep", "ep_imbalance", "ac_policy",
                "compile", "images_per_sample", "image_size", "max_pixels", "freeze_vision_tower", "freeze_projector",
                "freeze_language_model", "grad_ckpt", "objective", "liger", "float8", "float8_all_gather",
                "quant_base")
# fields that change nothing a decoder layer keeps in the learning run, and why
LAYER_FREE_FIELDS = {
    "gpu_memory": "the device's size", "cuda_context": "memory outside the allocator",
    "kbit_upcast": "a bitsandbytes base's (not learned: learning_need)",
    "double_quant": "a bitsandbytes base's (not learned: learning_need)",
    "loss_type": "the loss, after the layers", "precompute_ref_log_probs": "the reference's forward, no graph",
    "ref_dtype": "the reference copy's weights", "prompt_len": "which tokens the loss reads",
    "max_length": "a truncation --seq-len already holds", "beta": "a loss weight",
    "num_generations": "generation (learned as the plain step: plain_setup)",
    "max_completion_length": "generation", "use_vllm": "generation", "vllm_mode": "generation",
    "vllm_gpu_memory_utilization": "generation", "vllm_enable_sleep_mode": "generation",
    "vllm_max_model_length": "generation", "gradient_accumulation_steps": "steps between optimizer steps",
    "steps_per_generation": "generation", "generation_batch_size": "generation",
    "load_path": "the loading phase", "save_kind": "the saving phase", "logits_dtype": "the loss, after the layers",
    "ckpt_reentrant": "checkpointing, which the learning run turns off", "eval_batch_size": "the eval phase",
    "eval_keeps": "the eval phase", "eval_accumulation_steps": "the eval phase", "eval_samples": "the eval phase",
}
LEARN_ENV = "LLMEM_LEARN"          # auto (default): where no hand recipe exists; always; never
# bytes = c[0] + c[1] b + c[2] s + c[3] b s + c[4] b s^2: constants for weight-sized tensors, s for tensors shared by
# the batch (rotary cos/sin), b s per token, b s^2 for eager attention's scores and packed masks
TERMS = ("1", "b", "s", "b*s", "b*s^2")
Poly = tuple[float, ...]           # fitted exactly (fractions), kept as floats: evaluated at every estimate


def poly_at(p: Poly, b: int, s: int) -> int:
    """A fitted size at micro-batch b and s tokens per sample, in bytes (never negative)."""
    value = p[0] + p[1] * b + p[2] * s + p[3] * b * s + p[4] * b * s * s
    return max(int(round(value)), 0)


@dataclass(frozen=True)
class LearnedBlock:
    """A stretch of the decoder layer, from the first op of a parameter-owning module (a peft tuner layer counts as
    one, its adapters included) to the next one's: what it keeps and makes in forward order, and its backward
    transient as the largest of candidate polynomials (the transient's moment can move with b and s)."""
    name: str
    params: tuple[str, ...]                      # ".module.path." of the modules it owns (Block.params substrings)
    tensors: tuple[Poly, ...]                    # kept for backward, in allocation order
    temps: tuple[tuple[Poly, float, float], ...]   # forward temporaries (Block.temps positions)
    transients: tuple[Poly, ...]                 # candidates: transient = max(0, each at (b, s))

    def at(self, b: int, s: int) -> Block:
        transient = max((poly_at(p, b, s) for p in self.transients), default=0)
        return Block(self.name, tuple(poly_at(p, b, s) for p in self.tensors), self.params, transient,
                     temps=tuple((poly_at(p, b, s), a, f) for p, a, f in self.temps))


@dataclass(frozen=True)
class LearnedSelective:
    """What torchtitan's op-level selective checkpointing (--ac-policy op, llmem.memory.activations.selective) keeps
    of the learned layer: the outputs of the ops on its save list (every other aten.mm of the layer's forward, the
    SDPA kernel's), placed where the learned layer has them. An output the layer keeps for backward anyway is
    `stored` (block, kept tensor index); one its forward frees is an `extra` (block made in, its size, whether the
    recompute reads it: made before the layer's last kept tensor, where torch's early stop ends the recompute)."""
    stored: tuple[tuple[int, int], ...]
    extra: tuple[tuple[int, Poly, bool], ...]
    saved: tuple[str, ...]                       # "module within the layer: op" of each saved output, forward order

    @property
    def described(self) -> str:
        """The saved outputs in forward order, one per op call site ("self_attn.q_proj (mm), self_attn (aten::...)")."""
        sites = dict.fromkeys(f"{m} ({op})" for m, _, op in (x.partition(": ") for x in self.saved))
        return ", ".join(sites) or "no op on the save list"

    def at(self, b: int, s: int) -> SelectiveLayer:
        return SelectiveLayer(self.stored, tuple((j, poly_at(p, b, s), read) for j, p, read in self.extra),
                              self.saved)

    def to_json(self) -> dict:
        return {"stored": [list(x) for x in self.stored], "saved": list(self.saved),
                "extra": [[j, _encode(p), read] for j, p, read in self.extra]}

    @staticmethod
    def from_json(d: dict) -> LearnedSelective:
        return LearnedSelective(tuple((int(j), int(k)) for j, k in d["stored"]),
                                tuple((int(j), _decode(p), bool(read)) for j, p, read in d["extra"]),
                                tuple(d["saved"]))


@dataclass(frozen=True)
class LearnedActivations:
    """A decoder layer and what is kept outside the layers, learned from the real code (see llmem.learn)."""
    blocks: tuple[LearnedBlock, ...]
    embed: tuple[Poly, ...]
    head: tuple[Poly, ...]           # the final norm's tensors, then the lm_head's input (last)
    shared: tuple[Poly, ...]
    depth: int                       # decoder layers of the copy that was run
    points: tuple[tuple[int, int], ...]   # (batch, seq_len) points it was run at
    seconds: float                   # what learning took (the copy's steps and the fit)
    read_layer: int = 1              # the layer read (the others' differences are checked against it)
    selective: LearnedSelective | None = None   # learned for --ac-policy op only
    vision: LearnedVision | None = None         # a vision-language model's vision side
    # the decoder layers of a second kind (Llama 3.2 Vision's cross-attention layers, at its text config's
    # cross_attention_layers), read from layer 1 of a copy where it is one; `blocks` are then the other kind's
    # (its self-attention layers'); (): the layers are of one kind
    cross_blocks: tuple[LearnedBlock, ...] = ()

    def recipe(self, b: int, s: int) -> LayerRecipe:
        """The layer recipe at micro-batch b and seq_len s (the set-up's tokens per sample, before any virtual
        tokens: the fit includes them)."""
        return LayerRecipe(tuple(blk.at(b, s) for blk in self.blocks), tuple(poly_at(p, b, s) for p in self.embed),
                           tuple(poly_at(p, b, s) for p in self.head), tuple(poly_at(p, b, s) for p in self.shared))

    def cross_recipe_blocks(self, b: int, s: int) -> tuple[Block, ...]:
        """The cross-attention layers' blocks at micro-batch b and seq_len s (() for layers of one kind)."""
        return tuple(blk.at(b, s) for blk in self.cross_blocks)

    @property
    def note(self) -> str:
        pts = ", ".join(f"{b}x{s}" for b, s in self.points)
        if len(self.points) > 1:
            fit = f"sizes fitted in {', '.join(TERMS)}"
        elif self.vision is not None:
            fit = ("a vision-language step: at the micro-batch's own shape and images, its encoder attending image "
                   "by image")
        else:
            fit = "--compile: at the micro-batch's own shape, whose sizes decide what the partitioner saves"
        vision = (f"; its vision side read whole ({self.vision.described})" if self.vision is not None else "")
        read = (f"decoder layer {self.read_layer} read as every layer's" if not self.cross_blocks else
                f"decoder layer {self.read_layer} read twice, on a copy where it is a self-attention layer and on one "
                f"where it cross-attends to the image features ({len(self.cross_blocks)} blocks), each as every "
                "layer's of its kind")
        return (f"activations learned from the real code on a {self.depth}-layer copy at points {pts} (batch x "
                f"tokens; {fit}), {read}{vision}; "
                f"{len(self.blocks)} blocks, learned in {self.seconds:.1f} s" + (
                    f"; under --ac-policy op it keeps the outputs of {self.selective.described}"
                    if self.selective is not None else ""))

    # ------------------------------------------------------------------------------------------ JSON (the disk cache)
    def to_json(self) -> dict:
        enc = _encode
        return {"blocks": [_block_json(b) for b in self.blocks],
                **({"cross_blocks": [_block_json(b) for b in self.cross_blocks]} if self.cross_blocks else {}),
                "embed": [enc(p) for p in self.embed], "head": [enc(p) for p in self.head],
                "shared": [enc(p) for p in self.shared], "depth": self.depth,
                "points": [list(p) for p in self.points], "seconds": self.seconds, "read_layer": self.read_layer,
                **({"selective": self.selective.to_json()} if self.selective is not None else {}),
                **({"vision": self.vision.to_json()} if self.vision is not None else {})}

    @staticmethod
    def from_json(d: dict) -> LearnedActivations:
        dec = _decode
        blocks = tuple(map(_block_from, d["blocks"]))
        return LearnedActivations(blocks, tuple(dec(p) for p in d["embed"]), tuple(dec(p) for p in d["head"]),
                                  tuple(dec(p) for p in d["shared"]), int(d["depth"]),
                                  tuple((int(b), int(s)) for b, s in d["points"]), float(d["seconds"]),
                                  int(d.get("read_layer", 1)),
                                  LearnedSelective.from_json(d["selective"]) if "selective" in d else None,
                                  LearnedVision.from_json(d["vision"]) if "vision" in d else None,
                                  tuple(map(_block_from, d.get("cross_blocks", []))))


def _block_json(b: LearnedBlock) -> dict:
    return {"name": b.name, "params": list(b.params), "tensors": [_encode(p) for p in b.tensors],
            "temps": [[_encode(p), a, f] for p, a, f in b.temps], "transients": [_encode(p) for p in b.transients]}


def _block_from(b: dict) -> LearnedBlock:
    dec = _decode
    return LearnedBlock(b["name"], tuple(b["params"]), tuple(dec(p) for p in b["tensors"]),
                        tuple((dec(p), float(a), float(f)) for p, a, f in b["temps"]),
                        tuple(dec(p) for p in b["transients"]))


def _encode(p: Poly) -> list[str]:
    return [str(c) for c in p]


def _decode(p: list) -> Poly:
    return as_floats(tuple(Fraction(c) for c in p))


def as_floats(p) -> Poly:
    """A fitted polynomial's coefficients as floats (exact for the byte sizes of any real step: below 2^53)."""
    return tuple(float(c) for c in p)


# ---------------------------------------------------------------------------------------------- when to learn
def learning_mode() -> str:
    """$LLMEM_LEARN: auto (default: only where no hand recipe exists), always (also where one does: to check the
    hand recipes), never (the hand recipes, Llama's as the fallback, as before)."""
    mode = os.environ.get(LEARN_ENV, "auto").strip().lower() or "auto"
    return mode if mode in ("auto", "always", "never") else "auto"


def unevenly_adapted(r: ResolvedSetup) -> bool:
    """peft adapts the decoder layers differently (layers_to_transform, layer patterns): one layer read cannot stand
    for all. Compared by the modules each layer's trained parameters adapt (peft names them
    <module>.<adapter part>.default...): an adapter part shared between layers (Lily's, held by the first layer)
    leaves the others adapting the same modules through their own parts; the buffers peft adds count as adapting
    their module too (TinyLoRA's and UniLoRA's trained vectors are one list held by the first layer's module, the
    other layers' modules adapt through their own projection buffers). Layers of two kinds (Llama 3.2 Vision's
    cross-attention ones) are compared within their kind (each kind is read from a layer of its own)."""
    per_layer: dict[int, set[str]] = {i: set() for i in range(r.anatomy.num_layers)}
    for p in (*(q for q in r.anatomy.params if q.trainable), *r.anatomy.buffers):
        found = _layer_and_rest(p.name) if p.layer_index is not None else None
        if found is not None and found[0] in per_layer:
            per_layer[found[0]].add(_adapted_module(found[1]))
    crossing = cross_attention_layers(r.anatomy)
    return any(len({frozenset(v) for i, v in per_layer.items() if (i in crossing) == kind}) > 1
               for kind in (False, True))


def _adapted_module(rel: str) -> str:
    """The module a trained parameter adapts: mlp.gate_proj.lily_router.default.weight -> mlp.gate_proj; a trained
    base parameter (self_attn.q_proj.bias) -> its module."""
    head = rel.split(".default", 1)[0] if ".default" in rel else rel
    return head.rsplit(".", 1)[0] if "." in head else head


def _layer_and_rest(name: str) -> tuple[int, str] | None:
    """(decoder layer index, the path within the layer) of a parameter name: the first all-digit component after a
    ModuleList's name (model.layers.3.self_attn.q_proj.weight -> (3, self_attn.q_proj.weight))."""
    parts = name.split(".")
    for k, part in enumerate(parts[1:], 1):
        if part.isdigit():
            return int(part), ".".join(parts[k + 1:])
    return None


_UNEVEN: dict[int, tuple[object, bool]] = {}


def _uneven(r: ResolvedSetup) -> bool:
    hit = _UNEVEN.get(id(r.anatomy))
    if hit is None or hit[0] is not r.anatomy:
        hit = _UNEVEN[id(r.anatomy)] = (r.anatomy, unevenly_adapted(r))
    return hit[1]


def learning_need(r: ResolvedSetup) -> tuple[bool, str]:
    """(whether this set-up's activations are to be learned, why not when they cannot be). Learned where llmem has no
    recipe written for the family, or no exact model of the peft type; everywhere under LLMEM_LEARN=always."""
    mode = learning_mode()
    if mode == "never":
        return False, ""
    anatomy, setup = r.anatomy, r.setup
    inexact_peft = anatomy.peft is not None and not anatomy.peft.exact
    # --ac-policy op where the hand recipes' model of it does not reach (fused projections, post norms, ...):
    # which op made each tensor is learned with the layer
    selective_unmodelled = AC_POLICIES[setup.ac_policy].selective and hand_selective_refusal(anatomy) is not None
    wanted = (mode == "always" or family_of(anatomy.model_type).recipe is None or inexact_peft or selective_unmodelled
              or setup.compile       # what inductor's partitioner saves: learned with the real compile pipeline
              or bool(setup.images_per_sample))    # a vision-language step: its vision encoder's tensors
    if not wanted:
        return False, ""
    if r.layout.tp > 1:
        return False, "tensor parallelism (the copy runs on one GPU; its heads would not split the same way)"
    # a quantised base compiled with the layer (torchao's NF4): its dequantisation is ops of the layer's graph,
    # learned with it (the schedule lays out no transients of its own then: StepFacts.quant_tmp)
    if setup.quant_spec.quantised and not (setup.compile and setup.quant_spec.compiled):
        return False, ("a quantised base (the schedule lays out bitsandbytes' transients itself; the emulated "
                       "kernels' buffers are not told apart from the layer's tensors yet)")
    if anatomy.peft is not None and _uneven(r):
        return False, "peft adapts the decoder layers unevenly (one layer read would not stand for all)"
    if anatomy.varied_layers:
        return False, f"the decoder layers differ in {', '.join(anatomy.varied_layers)}"
    return True, ""


# ---------------------------------------------------------------------------------------------- the key and the cache

_KEYS: dict[tuple, tuple[object, object, dict]] = {}


def learning_key(r: ResolvedSetup) -> dict:
    """What the learned activations depend on: the model's config (its depth aside), the adapters, the dtype regime
    and the activation options, and the versions of the code that runs (torch, transformers, peft). Memoised per
    base anatomy and fields (a batch search asks for it at every shape)."""
    setup = r.setup
    memo = (id(r.base), id(r.anatomy), setup.peft_config, setup.lora_rank, setup.lora_alpha, setup.lora_targets, setup.lora_dropout,
            setup.precision, setup.adapter_dtype, setup.attn, setup.packing, setup.trust_remote_code, r.regime,
            r.gpu.compute_capability, r.layout.ep, setup.ep_imbalance, setup.ac_policy, own_shape(setup),
            vision_fields(setup), setup.objective, setup.liger, setup.float8, setup.float8_all_gather, setup.quant_base)
    hit = _KEYS.get(memo)
    if hit is not None and hit[0] is r.base and hit[1] is r.anatomy:
        return hit[2]
    key = _learning_key(r)
    _KEYS[memo] = (r.base, r.anatomy, key)     # the anatomies are held so that their ids are not reused
    return key


def _learning_key(r: ResolvedSetup) -> dict:
    setup, base = r.setup, r.base
    config = {k: v for k, v in base.config.items() if k not in _CONFIG_IGNORED}
    regime = r.regime
    if setup.peft_config:
        adapters = json.loads(read_peft_config(setup.peft_config)[0])
    elif setup.lora_rank:
        adapters = {"lora_rank": setup.lora_rank, "lora_alpha": setup.lora_alpha, "lora_targets": setup.lora_targets,
                    "lora_dropout": setup.lora_dropout}
    else:
        adapters = None
    return {"format": LEARN_FORMAT, "versions": code_versions(), "config": _strip_layers(config),
            "trust_remote_code": setup.trust_remote_code, "adapters": adapters,
            "regime": [regime.name, regime.res, regime.mm], "precision": setup.precision,
            "adapter_dtype": setup.adapter_dtype, "attn": setup.attn, "packing": setup.packing,
            "compute_capability": list(r.gpu.compute_capability) if r.gpu.compute_capability else None,
            # --ep: the rank's local experts and received rows (llmem.runtime.expert_parallel)
            **({"ep": r.layout.ep, "ep_imbalance": setup.ep_imbalance} if r.layout.ep > 1 else {}),
            # --ac-policy op: the layer is learned with the op that made each tensor (a file of its own)
            **({"ac_policy": setup.ac_policy} if AC_POLICIES[setup.ac_policy].selective else {}),
            # --compile: the layers compiled (llmem.runtime.compile), learned at the micro-batch's own shape
            **({"compile": list(own_shape(setup))} if setup.compile else {}),
            # ... over a quantised base whose dequantisation is compiled with the layer (learning_need)
            **({"quant_base": setup.quant_base} if setup.quant_spec.quantised else {}),
            # a vision-language step: its images and frozen parts, learned at the micro-batch's own shape
            **({"vision": [*vision_fields(setup), *own_shape(setup)]} if setup.images_per_sample else {}),
            # a TRL trainer's step runs in the learning copy (disable_dropout_in_model, its collator's batch)
            **({"objective": setup.objective} if _trainer_learned(setup) else {}),
            # Liger's Functions and torchao's float8 linears replace the layer's own modules in the learning copy
            **({"liger": setup.liger} if setup.liger != "none" else {}),
            **({"float8": [setup.float8, setup.float8_all_gather]} if setup.float8 != "none" else {})}


def _trainer_learned(setup) -> bool:
    """Whether the learning copy runs the objective's own trainer step (a generation objective's runs the plain
    step: llmem.learn.shallow_copy.learning_setup)."""
    spec = objective_spec(setup.objective)
    return spec.runs_trainer and not spec.generates


def vision_fields(setup) -> tuple:
    """The fields of a vision-language step the learned activations depend on (its images, its frozen parts)."""
    return (setup.images_per_sample, setup.image_size, setup.max_pixels, setup.freeze_vision_tower,
            setup.freeze_projector, setup.freeze_language_model, setup.grad_ckpt)


def own_shape(setup) -> tuple[int, int] | None:
    """The (batch, seq_len) a set-up's activations are learned at when they are learned at the micro-batch's own
    shape, else None (learned at llmem.learn's POINTS, fitted in TERMS):
    - --compile: the min-cut partitioner weighs each tensor's bytes, so what a compiled layer saves can change with
      the shape (an autocast weight copy saved at a few tokens, recomputed at many);
    - a vision-language step: its vision encoder attends image by image (transformers' SDPA path splits the
      patches per image and per window), so the number of its tensors changes with the batch."""
    return (setup.batch_size, setup.seq_len) if setup.compile or setup.images_per_sample else None


_CONFIG_IGNORED = {"_name_or_path", "name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache"}
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers")


def _strip_layers(config: dict) -> dict:
    """The config with its layer count (and lists as long as it: per-layer attention kinds) left out."""
    out = {}
    layers = next((config[k] for k in _LAYER_COUNTS if isinstance(config.get(k), int)), None)
    for k, v in config.items():
        if k in _LAYER_COUNTS or (isinstance(v, list) and layers is not None and len(v) == layers):
            continue
        out[k] = _strip_layers(v) if isinstance(v, dict) else v
    return out


def key_hash(key: dict) -> str:
    text = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cache_dir() -> Path:
    """Where learned activations are kept: llmem's cache folder (llmem.cache)."""
    return cache_root()


_MEMORY: dict[str, LearnedActivations] = {}


def cached(key: dict) -> LearnedActivations | None:
    """The learned activations for `key`: from memory, else from the disk cache (a damaged or foreign file is
    ignored), else None."""
    h = key_hash(key)
    hit = _MEMORY.get(h)
    if hit is not None:
        return hit
    path = cache_dir() / "learned" / f"{h}.json"
    try:
        data = json.loads(path.read_text())
        if data.get("key") != json.loads(json.dumps(key, sort_keys=True, default=str)):
            return None
        hit = LearnedActivations.from_json(data["learned"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    _MEMORY[h] = hit
    return hit


def remember(key: dict, learned: LearnedActivations) -> None:
    """Keep `learned` in memory and, where the cache folder can be written, on disk (written whole, then renamed)."""
    h = key_hash(key)
    _MEMORY[h] = learned
    folder = cache_dir() / "learned"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{h}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"key": json.loads(json.dumps(key, sort_keys=True, default=str)),
                                   "learned": learned.to_json()}))
        tmp.replace(folder / f"{h}.json")
    except OSError:
        pass


_FAILED: dict[str, str] = {}


def remember_failure(key: dict, why: str) -> None:
    """Learning was tried for `key` and refused (why): not tried again in this process."""
    _FAILED[key_hash(key)] = why


def learning_failure(r: ResolvedSetup) -> str | None:
    """Why this set-up's activations could not be learned (None: they were, or were not needed)."""
    need, why_not = learning_need(r)
    if not need:
        return why_not or None
    return _FAILED.get(key_hash(learning_key(r)))


def learned_for(r: ResolvedSetup) -> LearnedActivations | None:
    """The learned activations this set-up uses: learned already (memory or disk) and needed; else None."""
    need, _ = learning_need(r)
    return cached(learning_key(r)) if need else None


def learned_selective(r: ResolvedSetup) -> SelectiveLayer | None:
    """--ac-policy op on learned activations: what the layer keeps under the policy at the set-up's micro-batch
    shape, or None (not learned, or learned without it)."""
    learned = learned_for(r)
    if learned is None or learned.selective is None:
        return None
    return learned.selective.at(r.setup.batch_size, r.setup.seq_len)


def learned_recipe(r: ResolvedSetup) -> LayerRecipe | None:
    """The activation profile's hook: the learned layer recipe at the set-up's micro-batch shape, or None (the hand
    recipes then). Learning itself is llmem.learn's (a floor above the runtime, started by the estimator)."""
    learned = learned_for(r)
    return learned.recipe(r.setup.batch_size, r.setup.seq_len) if learned is not None else None


def learned_cross_blocks(r: ResolvedSetup) -> tuple[Block, ...]:
    """The learned blocks of the decoder layers of a second kind (Llama 3.2 Vision's cross-attention layers) at the
    set-up's micro-batch shape; () when the layers are of one kind or nothing was learned."""
    learned = learned_for(r)
    return learned.cross_recipe_blocks(r.setup.batch_size, r.setup.seq_len) if learned is not None else ()


def learned_vision(r: ResolvedSetup) -> LearnedVision | None:
    """A vision-language step's vision side at the set-up's shape, as learned with its layers (None when there is
    none, or nothing was learned)."""
    learned = learned_for(r)
    spec = vision_spec(r.anatomy.model_type)
    if learned is None or learned.vision is None or spec is None:
        return None
    return learned.vision


def activation_source_notes(r: ResolvedSetup) -> list[str]:
    """Where the estimate's activations come from, when not from a hand recipe: learned from the real code (and
    how), or the fallback (Llama's recipe for an unknown family, the frozen base's activations for a peft type
    without an exact model) and why nothing was learned. Empty for hand-recipe set-ups."""
    learned = learned_for(r)
    if learned is not None:
        return [learned.note]
    anatomy = r.anatomy
    fallbacks = []
    if family_of(anatomy.model_type).recipe is None:
        fallbacks.append(f"no activation recipe for model_type {anatomy.model_type!r}: the Llama recipe is used")
    if anatomy.peft is not None and not anatomy.peft.exact:
        kind = "DoRA with lora_dropout" if anatomy.peft.use_dora else anatomy.peft.peft_type
        fallbacks.append(f"no exact activation model for peft type {kind}: activations as for the frozen base")
    if not fallbacks:
        return []
    why = learning_failure(r)
    if why:
        lead = f"activations not learned from the real code ({why}); "
    elif learning_mode() == "never":
        lead = f"{LEARN_ENV}=never: "
    else:
        lead = ""
    return [lead + "; ".join(fallbacks) + ", so activations are approximate (llmem trace gives the exact step)"]


def forget_in_memory() -> None:
    """Drop the in-memory cache and the failures (tests; the disk cache stays)."""
    _MEMORY.clear()
    _FAILED.clear()
