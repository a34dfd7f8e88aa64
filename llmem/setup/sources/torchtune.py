"""torchtune's recipe YAML (torchtune's recipes/configs/): the model builder (`model._component_`), its LoRA keys
(lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output, lora_rank / alpha / dropout; use_dora: DoRA; the
qlora_ builders or quantize_base: a torchao NF4 base, QDoRA with use_dora), tokenizer.max_seq_len,
dataset.packed, batch_size, dtype, the optimizer component, optimizer_in_bwd, activation checkpointing and
offloading, and the recipe the file's `tune run` line names (a *_distributed recipe shards with FSDP2,
--nproc_per_node GPUs). The recipes whose step llmem does not model
(knowledge distillation, PPO, GRPO) and those that do not train (evaluation, generation, quantisation) are refused.

Precision: torchtune builds the model in `dtype` and trains it there (training.get_dtype): dtype bf16 is llmem's
pure bf16, and its LoRA modules are built in that dtype too (--adapter-dtype base). The NF4 base (torchao's
to_nf4) is never upcast (--no-kbit-upcast). The distributed recipes shard with fully_shard and no
MixedPrecisionPolicy: the shards are bf16."""

from __future__ import annotations

import json
import re
from functools import cache
from importlib import resources

from llmem.setup.optimizers import TORCHAO_FORMATS, torchao_row
from llmem.setup.sources.adapters import Lora, apply_lora
from llmem.setup.sources.deepspeed import GA_NOTE
from llmem.setup.sources.names import TORCH_CLASSES
from llmem.setup.sources.reading import Keys, Reading
from llmem.setup.sources.trl import batch_note


# torchtune's builders as its own source defines them (tools/make_torchtune_builders.py: each builder's dimensions,
# and the catalog model with the same ones), read once
@cache
def builders() -> dict[str, dict]:
    return json.loads(resources.files(__package__).joinpath("torchtune_builders.json").read_text())["builders"]


# torchtune's module names -> transformers' (torchtune's convert_weights mapping)
MODULES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
MLP = ("gate_proj", "up_proj", "down_proj")
# torchtune's builders that keep apart the projections transformers' class of the same model fuses: torchtune's phi3
# (models/phi3/_component_builders.py: q_proj, k_proj, v_proj and FeedForward's w1 / w3 separate linears; its
# _convert_weights.py splits Phi-3's checkpoint at loading) against transformers' Phi3Attention.qkv_proj and
# Phi3MLP.gate_up_proj. LoRA on the fused module stands in for LoRA on any projection inside it.
FUSED_IN_TRANSFORMERS = {"phi3": {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                                  "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}}
DTYPES = {"bf16": "bf16", "fp32": "fp32", "fp16": "fp16"}
TORCHTUNE_VERSION = "0.6.1"     # the torchtune whose builders torchtune_builders.json holds
TUNE_RUN = re.compile(r"^#\s*tune run\s+(?P<args>.*)$", re.MULTILINE)


# torchtune 0.6.1's recipes whose step llmem does not model, told by a top-level key only their configs have
# (recipes/knowledge_distillation_*.py, ppo_full_finetune_single_device.py, dev/grpo_full_finetune_distributed.py):
# refused by name rather than read as the supervised step of their policy / student
UNMODELLED_RECIPES = {
    "teacher_model": "knowledge_distillation (a teacher model's forward and the KD loss in every step)",
    "policy_model": "ppo_full_finetune (policy, reference, reward and value models with generation)",
    "grpo_samples": "dev/grpo_full_finetune_distributed (generation and a reference model in every step)",
}

# The recipes that keep what training.compile_loss returns (`self._loss_fn = training.compile_loss(self._loss_fn)`,
# torchtune 0.3.1 to 0.6.1: lora_finetune_single_device.py, knowledge_distillation_*.py): an unchunked loss runs
# compiled whole. The others call it and drop its value (full_finetune_single_device.py:294,
# full_finetune_distributed.py:345, lora_finetune_distributed.py:303, qat_distributed.py:310 in 0.6.1):
# torch.compile(module) returns a new OptimizedModule and leaves the module as it was, so their unchunked loss runs
# eagerly. A CEWithChunkedOutputLoss is compiled in place (its compute_cross_entropy replaced) either way.
LOSS_COMPILE_KEPT = ("lora_finetune_single_device", "knowledge_distillation_single_device",
                     "knowledge_distillation_distributed")

# torchtune 0.6.1's recipes that do not train (recipes/eleuther_eval.py, generate.py, quantize.py, dev/generate_v2*)
NOT_TRAINING = ("eleuther_eval", "generate", "quantize", "dev/generate_v2", "dev/generate_v2_distributed")


def detect(data: dict) -> bool:
    model = data.get("model", data.get("policy_model"))
    return isinstance(model, dict) and "_component_" in model


def read(keys: Keys, r: Reading, text: str) -> None:
    r.multi_gpu_method = "fsdp"
    _refuse_unmodelled(r, keys)
    model = keys.sub("model")
    component = str(model.get("_component_"))
    builder = component.rsplit(".", 1)[-1]
    qlora = builder.startswith("qlora_")
    lora = qlora or builder.startswith("lora_")
    base = builder.split("_", 1)[1] if lora else builder
    if not component.startswith("torchtune.models."):
        raise r.error("model._component_", component, "is not a torchtune model builder",
                      "name one of torchtune.models.* (or give MODEL on the command line)")
    row = builders().get(base)
    if row is not None and row["hub_id"]:
        r.set("model._component_", component, "model", row["hub_id"], f"torchtune's {base}: the same dimensions")
    else:
        why = "is not a builder of torchtune " + TORCHTUNE_VERSION if row is None else \
            "has dimensions no catalog model has"
        r.ignore("model._component_", component, f"torchtune's {base} {why}: give MODEL on the command line")
    recipe = _recipe(r, text)
    batch = r.integer("batch_size", keys.get("batch_size", 1), what="a micro-batch")
    loss_type = _preference_loss(str(keys.sub("loss").get("_component_", "")))
    r.set("batch_size", keys.get("batch_size", 1), "batch_size", batch, batch_note("dpo" if loss_type else "sft"))
    tokenizer = keys.sub("tokenizer")
    seq = tokenizer.get("max_seq_len")
    if seq is not None:
        r.set("tokenizer.max_seq_len", seq, "seq_len", r.integer("tokenizer.max_seq_len", seq,
                                                                   what="a sequence length"))
        if loss_type:
            r.set("tokenizer.max_seq_len", seq, "max_length", r.integer("tokenizer.max_seq_len", seq),
                  "each sequence's truncation")
    else:
        r.ignore("tokenizer.max_seq_len", None, "no limit: the data's longest sample decides (llmem's --seq-len)")
    for key in ("_component_", "path", "prompt_template"):
        tokenizer.get(key)
    dataset = keys.sub("dataset")
    if dataset.get("packed"):
        r.set("dataset.packed", True, "packing", True)
    for key in ("_component_", "split", "packed"):
        dataset.get(key)
    if "gradient_accumulation_steps" in keys:
        r.note_used("gradient_accumulation_steps", keys.get("gradient_accumulation_steps"), GA_NOTE)
    dtype = r.choice("dtype", keys.get("dtype", "bf16"), DTYPES)
    r.note_used("dtype", keys.get("dtype", "bf16"), f"the model built and trained in {dtype}")
    r.dtype(compute=dtype, weights=dtype, adapters="base", kbit_upcast=False)
    _optimizer(r, keys)
    if "optimizer_in_bwd" in keys and r.boolean("optimizer_in_bwd", keys.get("optimizer_in_bwd")):
        r.set("optimizer_in_bwd", True, "optimizer_in_backward", True)
    if "enable_activation_checkpointing" in keys:
        r.set("enable_activation_checkpointing", keys.get("enable_activation_checkpointing"), "grad_ckpt",
              r.boolean("enable_activation_checkpointing", keys.get("enable_activation_checkpointing")))
    if "enable_activation_offloading" in keys and r.boolean("enable_activation_offloading",
                                                            keys.get("enable_activation_offloading")):
        r.set("enable_activation_offloading", True, "offload_activations", True)
    if keys.get("ac_mode") == "selective" and isinstance(keys.get("ac_option"), int):
        r.set("ac_option", keys.get("ac_option"), "ckpt_every", r.integer("ac_option", keys.get("ac_option")))
    if lora:
        _lora(r, model, qlora, FUSED_IN_TRANSFORMERS.get(row["component"], {}) if row else {})
    _loss(r, keys.sub("loss"))
    _distributed(r, keys)
    _compile(r, keys, recipe)
    keys.get("ac_mode")
    r.not_read(keys)


def _refuse_unmodelled(r: Reading, keys: Keys) -> None:
    for key, recipe in UNMODELLED_RECIPES.items():
        if key in keys:
            raw = keys.get(key)
            raise r.error(key, raw.get("_component_", "...") if isinstance(raw, dict) else raw,
                          f"marks torchtune's {recipe}, a recipe llmem does not model",
                          "give the set-up with flags (llmem estimate MODEL --lora-rank ... --objective ...)")


def _recipe(r: Reading, text: str) -> str:
    """The file's documented launch line, `tune run [--nproc_per_node N] RECIPE --config NAME`: its recipe ("" when
    the file has none)."""
    match = TUNE_RUN.search(text)
    if match is None:
        return ""
    words = match.group("args").split()
    recipe = next((w for w in words if not w.startswith("-") and not w.isdigit()), "")
    nproc = next((words[i + 1] for i, w in enumerate(words[:-1]) if w == "--nproc_per_node"), None)
    if recipe in NOT_TRAINING:
        raise r.error("# tune run", recipe, "is a torchtune recipe that does not train (evaluation, generation or "
                      "quantisation): nothing to estimate", "give a fine-tuning recipe's config")
    if recipe.endswith("_distributed") or "distributed" in recipe:
        r.method = "fsdp"
        gpus = r.integer("# tune run --nproc_per_node", nproc, what="a process count") if nproc else None
        r.gpus = gpus
        r.note_used("# tune run", match.group("args").strip(), f"{recipe}: FSDP2's fully_shard"
                    + (f" over gpus = {gpus}" if gpus else ""))
    elif recipe:
        r.method, r.gpus = "single", 1
        r.note_used("# tune run", match.group("args").strip(), f"{recipe}: one GPU")
    return recipe


def _compile(r: Reading, keys: Keys, recipe: str) -> None:
    """`compile: True`: training.compile_model (each decoder layer, inside its checkpoint wrapper) and
    training.compile_loss: the chunked loss's compute_cross_entropy (llmem.runtime.compiled_loss); an unchunked loss
    compiled whole only by the recipes that keep compile_loss's value (LOSS_COMPILE_KEPT), which llmem does not
    model (it runs the loss eagerly, as the other recipes do)."""
    if not keys.get("compile"):
        return
    chunked = "output_chunks" in r.values
    r.set("compile", True, "compile", True, "each decoder layer compiled (training.compile_model)"
          + (" and the chunked loss's cross-entropy (training.compile_loss)" if chunked else ""))
    if chunked:
        return
    if recipe and recipe not in LOSS_COMPILE_KEPT:
        r.note_used("compile (the loss)", True, f"the loss runs eagerly, as estimated: {recipe} calls training.compile_loss "
                    "and drops the compiled copy it returns")
        return
    r.ignore("compile (the loss)", True, ("" if recipe else "if the recipe keeps what training.compile_loss "
             "returns (lora_finetune_single_device does): ") + "the unchunked loss runs compiled whole, not "
             "modelled (the loss runs eagerly in the estimate)")


def _optimizer(r: Reading, keys: Keys) -> None:
    opt = keys.sub("optimizer")
    component = str(opt.get("_component_", "torch.optim.AdamW"))
    row = TORCH_CLASSES.get(component)
    fused = opt.get("fused", False)
    for key in ("lr", "weight_decay", "betas", "eps", "momentum", "foreach"):
        opt.get(key)
    if row is None or row.llmem is None:
        r.ignore("optimizer._component_", component, (row.note if row else "not in llmem's optimizer registry")
                 + ": llmem's optimizer stands in")
        return
    name = row.llmem
    if name == "adamw" and fused:
        name = "adamw-fused"
    if name == "sgd" and opt.get("momentum", 0):
        name = "sgd-momentum"
    block = opt.get("block_size") if name in TORCHAO_FORMATS else None
    if block is not None:       # torchao's optimizers take block_size (AdamW8bit / AdamWFp8 256, AdamW4bit 128)
        sized = torchao_row(TORCHAO_FORMATS[name].torchao_class, int(block))
        if sized is None:
            r.ignore("optimizer.block_size", block, f"llmem models {component} with the block sizes of its rows "
                     f"only: {TORCHAO_FORMATS[name].block_size} stands in")
        name = sized or name
    r.set("optimizer._component_" + (" + fused" if fused else ""), component, "optimizer", name, row.note)


def _lora(r: Reading, model: Keys, qlora: bool, fused: dict[str, str]) -> None:
    attn = [str(m) for m in model.get("lora_attn_modules", ["q_proj", "v_proj"])]
    names = [MODULES.get(m, m) for m in attn]
    if model.get("apply_lora_to_mlp", False):
        names += MLP
    if model.get("apply_lora_to_output", False):
        names.append("lm_head")
    if any(n in fused for n in names):
        split = [n for n in names if n in fused]
        names = list(dict.fromkeys(fused.get(n, n) for n in names))
        r.ignore("model.lora_attn_modules + apply_lora_to_mlp", split,
                 "torchtune's model keeps these projections apart, transformers' fuses them: LoRA on "
                 f"{', '.join(dict.fromkeys(fused[n] for n in split))} stands in (one adapter pair over the fused "
                 "width, r x (in + fused out), instead of r x (in + out) per projection: fewer adapter parameters, "
                 "the same frozen base)")
    rank = r.integer("model.lora_rank", model.get("lora_rank", 8), what="a LoRA rank")
    dora = "use_dora" in model and r.boolean("model.use_dora", model.get("use_dora"))
    lora = Lora(rank, float(model.get("lora_alpha", 16)), r.fraction("model.lora_dropout",
                                                                      model.get("lora_dropout", 0.0)),
                ",".join(names), use_dora=dora)
    sources = {"lora_rank": ("model.lora_rank", model.get("lora_rank")),
               "lora_alpha": ("model.lora_alpha", model.get("lora_alpha")),
               "lora_dropout": ("model.lora_dropout", model.get("lora_dropout")),
               "lora_targets": ("model.lora_attn_modules + apply_lora_to_mlp / _output",
                                f"{attn}, mlp {model.get('apply_lora_to_mlp', False)}, output "
                                f"{model.get('apply_lora_to_output', False)}")}
    if dora:        # DoRALinear: peft's DoRA layer's forward (the x_eye weight norm, detached; a magnitude vector)
        sources["use_dora"] = ("model.use_dora", True)
    apply_lora(r, lora, sources)
    # the qlora_* builders are the lora_* ones with quantize_base=True (models/*/_model_builders.py)
    quantize = "quantize_base" in model and r.boolean("model.quantize_base", model.get("quantize_base"))
    if qlora or quantize:
        key, raw = ("model.quantize_base", True) if quantize else ("model._component_", "qlora_*")
        r.set(key, raw, "quant_base", "torchao-nf4", "torchao NF4Tensor base (to_nf4)" +
              (": QDoRA" if dora else ""))


# torchtune's preference losses (torchtune/rlhf/loss/dpo.py, 0.6.1) -> TRL's DPO loss_type of the same formula
PREFERENCE_LOSSES = {"DPOLoss": "sigmoid", "RSOLoss": "hinge"}


def _preference_loss(component: str) -> str | None:
    return PREFERENCE_LOSSES.get(component.rsplit(".", 1)[-1])


def _loss(r: Reading, loss: Keys) -> None:
    component = str(loss.get("_component_", ""))
    if component.endswith("CEWithChunkedOutputLoss"):
        # the recipes' set_num_output_chunks(loss_fn.num_output_chunks): the model's chunked_output feeds the loss
        chunks = loss.get("num_output_chunks", 8)
        r.set("loss.num_output_chunks", chunks, "output_chunks", r.integer("loss.num_output_chunks", chunks),
              "torchtune's chunked output: the lm_head per chunk, each chunk upcast and cross-entropied alone")
    elif component.endswith("LinearCrossEntropyLoss"):
        r.ignore("loss._component_", component, "torchtune's LinearCrossEntropyLoss projects and upcasts chunk by "
                 "chunk, but keeps every chunk's fp32 log-probabilities for backward (all the logits' worth): "
                 "modelled as the unfused loss (an upper bound; --fused-ce gives the lower one)")
    elif loss_type := _preference_loss(component):
        r.set("loss._component_", component, "objective", "dpo", "torchtune's DPO recipes: the reference forward "
              "with the adapters disabled (LoRA) or a frozen copy (full)")
        r.set("loss._component_", component, "loss_type", loss_type)
        r.ignore("loss._component_", component, "torchtune's recipe keeps the whole logits of both rows in the "
                 "model's dtype (concatenated_forward), where TRL's chunked head is modelled")
    loss.get("num_output_chunks")     # (read above for the chunked output loss; other losses ignore it)


# training.shard_model's custom_sharded_layers llmem expresses: the embedding and the lm_head, each a unit of its own
SHARDED_EMBEDDINGS = {"tok_embeddings", "output"}


def _custom_sharded_layers(r: Reading, names) -> None:
    """custom_sharded_layers: fully_shard on each module named (get_shard_conditions), besides the layers and the
    root; ['tok_embeddings', 'output'] is --shard-embeddings under fsdp / zero2, any other list stays with the
    root."""
    if not names:
        return
    if isinstance(names, list | tuple) and set(map(str, names)) == SHARDED_EMBEDDINGS \
            and r.method in ("fsdp", "zero2"):
        r.set("custom_sharded_layers", names, "shard_embeddings", True, "the embedding and the lm_head FSDP2 units "
              "of their own (training.shard_model)")
        return
    r.ignore("custom_sharded_layers", names, "FSDP units of their own other than ['tok_embeddings', 'output'] "
             f"under fsdp / zero2 (method {r.method}): llmem's fsdp shards them with the root")


def _distributed(r: Reading, keys: Keys) -> None:
    if r.method is None and any(k in keys for k in ("fsdp_cpu_offload", "custom_sharded_layers",
                                                     "fsdp_reshard_after_forward", "tensor_parallel_dim")):
        r.method = "fsdp"
        r.note_used("(distributed keys)", "fsdp_*", "a distributed recipe: FSDP2's fully_shard")
    if "fsdp_reshard_after_forward" in keys and r.method == "fsdp":
        if not r.boolean("fsdp_reshard_after_forward", keys.get("fsdp_reshard_after_forward")):
            r.method = "zero2"
        r.note_used("fsdp_reshard_after_forward", keys.get("fsdp_reshard_after_forward"), f"method {r.method}")
    if keys.get("fsdp_cpu_offload"):
        r.ignore("fsdp_cpu_offload", True, "FSDP's CPU offload of parameters (CPUOffloadPolicy) is not modelled yet: "
                 "estimated with the parameters on the GPU (an upper bound)")
    tp = keys.get("tensor_parallel_dim", 1)
    if r.integer("tensor_parallel_dim", tp) > 1:
        r.set("tensor_parallel_dim", tp, "tp", tp)
        r.method = "fsdp+tp"
    _custom_sharded_layers(r, keys.get("custom_sharded_layers"))
    keys.sub("tensor_parallel_plan")
    if "quantizer" in keys:     # qat_distributed / qat_lora_finetune_distributed
        r.ignore("quantizer._component_", keys.sub("quantizer").get("_component_"), "quantization-aware training "
                 "(torchao's fake-quantised weights and activations in every forward) is not modelled: the "
                 "unquantised step stands in")
        keys.sub("quantizer").get("groupsize")
    for key in ("device", "seed", "shuffle", "epochs", "max_steps_per_epoch", "output_dir", "resume_from_checkpoint",
                "log_every_n_steps", "log_peak_memory_stats", "log_level", "clip_grad_norm", "batch_size_val",
                "run_val_every_n_steps", "save_adapter_weights_only", "low_cpu_ram"):
        keys.get(key)
    for key in ("checkpointer", "metric_logger", "profiler", "lr_scheduler", "dataset_val"):
        keys.sub(key)
