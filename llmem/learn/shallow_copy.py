"""The learned activations of a set-up: the model's shallow copy (LEARN_DEPTH decoder layers) run at the POINTS
(llmem.learn.one_point), its sizes fitted (llmem.learn.fit) and its layer read (llmem.learn.layer_blocks); cached
per key (llmem.memory.activations.learned)."""

from __future__ import annotations

import copy
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from llmem.learn.fit import check_alike, fit_sizes
from llmem.learn.layer_blocks import read_layer
from llmem.learn.one_point import run_point
from llmem.learn.points import LEARN_DEPTH, POINTS, READ_LAYER, LearnError, Reading
from llmem.memory.activations.learned import (
    LearnedActivations,
    cached,
    learning_key,
    learning_need,
    own_shape,
    remember,
)
from llmem.model.families import LAYERS_FIELDS, family_of
from llmem.model.peft import read_peft_config
from llmem.model.resolved import ResolvedSetup
from llmem.model.vision import text_section, vision_spec
from llmem.runtime.expert_parallel import learning_ep
from llmem.setup.checkpointing import AC_POLICIES
from llmem.setup.generation import plain_setup
from llmem.setup.objectives import ObjectiveSpec, objective_spec
from llmem.setup.sections import DeepSpeedConfig, JobConfig, ParallelismConfig


def learned_activations(r: ResolvedSetup) -> LearnedActivations | None:
    """The learned activations of `r` when it needs them (learning_need), from the cache or learned now; None when it
    does not need them. LearnError when they cannot be learned."""
    need, why_not = learning_need(r)
    if not need:
        if why_not:
            raise LearnError(f"activations cannot be learned for this set-up: {why_not}")
        return None
    key = learning_key(r)
    hit = cached(key)
    if hit is not None:
        return hit
    learned = learn(r)
    remember(key, learned)
    return learned


def learn(r: ResolvedSetup, points: tuple[tuple[int, int], ...] | None = None) -> LearnedActivations:
    """Run the copy at `points` (POINTS; under --compile the micro-batch's own shape alone) and fit what its layers
    keep (not cached: learned_activations caches). Decoder layers of two kinds (Llama 3.2 Vision's cross-attention
    layers among its self-attention ones): two copies, layer 1 a cross-attention layer in the first (its layer 0 a
    self-attention one, as the model's first layer is: the embedding, the vision side and the head are read there)
    and a self-attention one in the second (its layer 0 cross-attends, so the vision side still reaches the loss)."""
    field = cross_attention_field(r)
    if not field:
        return _learn(r, points, shallow_config(r.base.config, LEARN_DEPTH))
    crossing = _learn(r, points, shallow_config(r.base.config, LEARN_DEPTH, {field: [READ_LAYER]}))
    plain = _learn(r, points, shallow_config(r.base.config, LEARN_DEPTH, {field: [READ_LAYER - 1]}))
    return replace(crossing, blocks=plain.blocks, cross_blocks=crossing.blocks,
                   seconds=round(crossing.seconds + plain.seconds, 2))


def cross_attention_field(r: ResolvedSetup) -> str:
    """The text config's field listing the decoder layers that cross-attend to the image features (the VLM row's
    cross_attention_layers), "" when the layers are of one kind."""
    spec = vision_spec(r.anatomy.model_type)
    return spec.cross_attention_layers if spec is not None else ""


def _learn(r: ResolvedSetup, points: tuple[tuple[int, int], ...] | None, config: dict) -> LearnedActivations:
    shape = own_shape(r.setup)
    copied = _copy_objective(r.setup)
    # KTO's micro-batch is whole (desirable, undesirable) halves: its copy runs POINTS' batches in those units
    points = points or ((shape,) if shape is not None else tuple((b * copied.batch_multiple, s) for b, s in POINTS))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="llmem-learn-") as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(config))
        peft_folder = shallow_peft_config(r, Path(folder))
        readings: list[Reading] = []
        for b, s in points:          # each point checked against the first as it comes: a refusal costs two runs
            copy_setup = learning_setup(r, str(path), b, s)
            if peft_folder is not None:
                copy_setup = replace(copy_setup, peft_config=str(peft_folder))
            with learning_ep(r.setup.ep, r.setup.ep_imbalance):   # --ep: the EP forward, all-to-alls emulated
                readings.append(run_point(copy_setup, vision_checkpointing=vision_checkpointing(r)))
            check_alike(readings, points)
    # a paired objective's copy (DPO's chosen and rejected, concatenated in one forward) runs sequences_per_sample
    # rows a sample: the sizes are fitted per row, the batch the schedule reads them at (the doubled batch of
    # llmem.estimator.objectives.objective_view)
    rows = tuple((b * copied.sequences_per_sample, s) for b, s in points)
    sizes = fit_sizes(readings, rows)
    return read_layer(readings[0], sizes, rows, time.perf_counter() - t0,
                      selective=AC_POLICIES[r.setup.ac_policy].selective)


def _copy_objective(setup) -> ObjectiveSpec:
    """The objective the learning copy's step runs (learning_setup: a generation objective's runs the plain step)."""
    spec = objective_spec(setup.objective)
    return objective_spec("sft") if spec.generates else spec


# peft config fields that count the decoder layers an adapter spans: adaption prompt's adapter_layers (its
# adapters on the top N layers, peft/tuners/adaption_prompt/model.py refuses N above the model's depth) and prompt
# learning's num_layers (the past key values made per layer; peft fills it from the model's config when unset)
LAYER_COUNT_FIELDS = ("adapter_layers", "num_layers")


def shallow_peft_config(r: ResolvedSetup, folder: Path) -> Path | None:
    """The --peft-config as the copy takes it, written under `folder`: a layer count that spans every decoder layer
    of the model cut to the copy's LEARN_DEPTH (one that spans fewer adapts the layers unevenly, which learning
    refuses). None when the config has no such field (the user's config is taken as it is)."""
    if not r.setup.peft_config:
        return None
    fields = json.loads(read_peft_config(r.setup.peft_config)[0])
    found = [n for n in LAYER_COUNT_FIELDS if isinstance(fields.get(n), int) and fields[n] == r.anatomy.num_layers]
    if not found:
        return None
    fields.update(dict.fromkeys(found, LEARN_DEPTH))
    out = folder / "peft"
    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps(fields))
    return out


def vision_checkpointing(r: ResolvedSetup) -> bool:
    """Whether the copy runs its vision encoder's blocks checkpointed: a vision-language step under --grad-ckpt. The
    encoder's forward and backward are then read as they run (its blocks' inputs kept, each recomputed in its
    backward; transformers' hooks on every input embedding make even a frozen encoder run them); its decoder layers
    run plain (the schedule lays their checkpointing out)."""
    return r.setup.grad_ckpt and bool(r.setup.images_per_sample)


def shallow_config(config: dict, depth: int, text_fields: dict | None = None) -> dict:
    """The model's own config with `depth` decoder layers: the layer count of the text config (multimodal configs
    nest it) and the per-layer lists as long as it (attention kinds per layer) cut to `depth`; `text_fields` set on
    the text config last (the copy's cross-attention layers)."""
    out = copy.deepcopy(config)
    holder = text_section(out)
    name = next((n for n in LAYERS_FIELDS if isinstance(holder.get(n), int)), None)
    if name is None:
        raise LearnError("the model's config names no layer count (num_hidden_layers): no shallow copy to learn from")
    layers = holder[name]
    for k, v in list(holder.items()):
        if isinstance(v, list) and len(v) == layers and layers != depth:
            holder[k] = v[:depth]
    holder[name] = depth
    holder.update(family_of(str(holder.get("model_type", out.get("model_type")))).learn_copy)   # layer 1 a routed one
    holder.update(text_fields or {})
    return out


def learning_setup(r: ResolvedSetup, model_path: str, batch: int, seq: int):
    """The set-up the copy runs: the same adapters, precision and activation options on one GPU (the method's dtype
    regime kept: FSDP2's mixed precision computes in the low dtype, as pure low precision does), without the
    options the schedule lays out itself (checkpointing, offloading, the fused or chunked loss, the optimizer's
    placement).
    A generation objective's copy runs the plain step: its layers' tensors are the training forward's (the schedule
    lays generate out itself), and GRPOConfig's checks (num_generations dividing the batch, a completion shorter
    than the sequence) would refuse the learning points."""
    setup = plain_setup(r.setup) if objective_spec(r.setup.objective).generates else r.setup
    precision = setup.precision
    adapter_dtype = setup.adapter_dtype
    if setup.mixed and not r.regime.autocast:        # FSDP2's MixedPrecisionPolicy: everything computes in low
        precision = setup.precision_spec.compute_dtype.replace("bfloat16", "bf16").replace("float16", "fp16")
        adapter_dtype = "base"
    # one GPU: the layout's, DeepSpeed's and the job's sections at their defaults (a ZeRO bucket size, an HSDP degree
    # or an FSDP2 / ZeRO-3 save kind of the user's set-up would be refused on it, whatever the cache held; the copy
    # runs the step only)
    return replace(setup, model=model_path, parallelism=ParallelismConfig(), deepspeed=DeepSpeedConfig(),
                   job=JobConfig(),
                   batch_size=batch, seq_len=seq, precision=precision, adapter_dtype=adapter_dtype, **LEARNING_RESETS)


# what the learning run sets whatever the set-up says (the schedule lays these out itself); with the parallelism
# and DeepSpeed sections at their defaults and the shape, precision and adapter dtype learning_setup gives
LEARNING_RESETS = dict(optimizer="adamw", grad_ckpt=False, ckpt_every=1, offload_activations=False, fused_ce=False,
                       offload_optimizer=False, optimizer_in_backward=False, expandable_segments=False,
                       ac_policy="full", output_chunks=0, ckpt_offload="none")


