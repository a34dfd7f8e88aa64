"""The model the step trains: the HF causal LM built from its config on the meta device, peft's adapters, the
checkpointing and loss options, then materialised (fake tensors for the trace, random weights for measure)."""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

from llmem.errors import LlmemError
from llmem.model.config import build_meta_model, resolve_config, training_config
from llmem.model.families import text_config
from llmem.model.peft import (
    BASE_DTYPE_BUFFERS,
    apply_peft_config,
    buffer_dicts,
    lora_target_names,
    read_peft_config,
)
from llmem.model.sharding import linear_layer_class
from llmem.model.vision import under, vision_spec
from llmem.runtime.patches import FLASH_KERNEL, flash_kernel_attention, quiet
from llmem.runtime.selective_ac import CONTEXT_FNS
from llmem.setup.attention import AttentionSpec
from llmem.setup.objectives import objective_spec
from llmem.setup.training import LORA_ALL_LINEAR, lora_target_regex


def meta_model_for(setup):
    """The HF causal LM on the meta device, with the setup's attention implementation, no KV cache, train mode."""
    # --attn flash: HF's flash_attention_2 needs the flash-attn package; its kernel is modelled by PyTorch's flash
    # SDPA kernel (same saved tensors: q, k, v, out, logsumexp), so the model runs its SDPA implementation, or
    # llmem's flash-kernel one where the class has flash attention but no SDPA one (Gemma-2: softcapping)
    _, cfg = resolve_config(setup.model, setup.trust_remote_code)
    cfg = training_config(cfg)
    attn = attention_implementation(cfg, setup.attention_spec)
    with warnings.catch_warnings(), flash_kernel_attention():
        warnings.simplefilter("ignore")
        try:
            cfg._attn_implementation = attn
        except Exception:  # noqa: BLE001 - some configs validate lazily; set_attn_implementation below decides
            pass
        model = build_meta_model(cfg, setup.trust_remote_code, objective_spec(setup.objective).scalar_head)
        if getattr(model.config, "_attn_implementation", None) != attn:
            try:
                model.set_attn_implementation(attn)
            except Exception as exc:  # noqa: BLE001
                raise LlmemError(f"{type(model).__name__} does not support attn={setup.attn!r}: {exc}") from None
    model.config.use_cache = False
    # from_config follows the config's torch_dtype (often fp16/bf16): training keeps fp32 parameters unless the
    # setup says pure bf16/fp16 (cast by the caller)
    model.to(torch.float32)
    model.train()
    return model


def attention_implementation(cfg, requested: AttentionSpec) -> str:
    """The attn_implementation the step builds for --attn `requested`, from the class's own flags as every engine
    reads them (llmem.setup.support): sdpa where the class has it, else eager (transformers' own fallback; the
    estimate and the setup record say eager too); flash as SDPA's flash kernel, or llmem's flash-kernel
    implementation on a class with flash but no SDPA attention. Classes outside transformers' mapping (remote
    code) get the request as it is."""
    if requested.keeps_scores:
        return "eager"
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    except (KeyError, ValueError):
        return "sdpa"
    if getattr(cls, "_supports_sdpa", False):
        return "sdpa"
    return FLASH_KERNEL if requested.flash_kernel else "eager"


def apply_peft(model: nn.Module, setup) -> nn.Module:
    """peft on the meta model (adapters, prompts and the trainable set from peft itself): --lora-rank builds a
    LoraConfig, --peft-config loads the user's adapter_config.json. The frozen base is kept in the compute dtype, as
    fine-tuning scripts load it. --adapter-dtype fp32 is get_peft_model(autocast_adapter_dtype=True), peft's
    default: under pure bf16/fp16 (the model already cast) peft upcasts the adapters to fp32; base is False: they
    follow the base layer's dtype. Under *-mixed peft builds them on the fp32 model (fp32 either way) and the frozen
    base is cast to the compute dtype after."""
    from peft import LoraConfig, get_peft_model

    if setup.peft_config:
        text, fields = read_peft_config(setup.peft_config)
        if fields.get("use_dora") and setup.quant_spec.quantised:
            raise LlmemError("DoRA on a bitsandbytes-quantised base is not emulated in trace (peft dequantises the "
                             "weight every forward); llmem estimate models it analytically")
        with quiet():
            peft_model = apply_peft_config(model, text, setup.adapter_dtype == "fp32")
    else:
        config = LoraConfig(r=setup.lora_rank, lora_alpha=setup.lora_alpha, lora_dropout=setup.lora_dropout,
                            target_modules=_peft_targets(model, setup.lora_targets), task_type="CAUSAL_LM")
        with quiet():
            try:
                peft_model = get_peft_model(model, config, autocast_adapter_dtype=setup.adapter_dtype == "fp32")
            except ValueError as exc:
                raise LlmemError(f"LoRA targets {setup.lora_targets!r}: {exc}") from None
    cast_frozen(peft_model, setup)
    return peft_model


def cast_frozen(model: nn.Module, setup) -> None:
    """Under *-mixed, the frozen parameters in the compute dtype (the trained ones stay fp32 masters): the frozen
    base as fine-tuning scripts load it (torch_dtype), peft's or a frozen part's (LLaMA-Factory upcasts only the
    trained parameters to fp32)."""
    low = low_dtype(setup)
    if setup.mixed and low is not None:
        cast: dict[int, nn.Parameter] = {}      # by identity, so tied weights stay one tensor
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and not p.requires_grad and p.is_floating_point():
                    if id(p) not in cast:
                        cast[id(p)] = nn.Parameter(p.to(low), requires_grad=False)
                    module._parameters[name] = cast[id(p)]
        # the buffers peft makes in the base layer's dtype (FRoD's U and V), as on the base loaded in it
        for module, key, b in buffer_dicts(model, BASE_DTYPE_BUFFERS):
            if b.is_floating_point():
                module._buffers[key] = b.to(low)



def _peft_targets(model: nn.Module, targets: str) -> str | set[str]:
    """--lora-targets as peft's target_modules: a "re:" pattern as peft's string form; all-linear alone is peft's own
    shorthand; beside other names (e.g.
    all-linear,lm_head) peft would read it as a module name, so it is expanded by peft's own rule
    (_maybe_include_all_linear_layers: every Linear / Conv1D but the output layer) and the others added."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers

    pattern = lora_target_regex(targets)
    if pattern is not None:          # peft re.fullmatch-es a string target_modules against each module's name
        return pattern
    names = lora_target_names(targets)
    if vision_spec(getattr(model.config, "model_type", "")) is not None:
        from llmem.runtime.vision import language_lora_targets

        return language_lora_targets(model, names, LORA_ALL_LINEAR)
    if LORA_ALL_LINEAR not in names:
        return set(names)
    expanded = _maybe_include_all_linear_layers(LoraConfig(target_modules=LORA_ALL_LINEAR), model).target_modules
    linear = _linears_proper(model, set(expanded))
    if linear is not None:
        return linear | (set(names) - {LORA_ALL_LINEAR})
    if names == [LORA_ALL_LINEAR]:
        return LORA_ALL_LINEAR
    return set(expanded) | (set(names) - {LORA_ALL_LINEAR})


def _linears_proper(model: nn.Module, expanded: set[str]) -> set[str] | None:
    """The full names of the modules peft's all-linear takes (`expanded`: their names, full in peft 0.21) that are
    linear layers (llmem.model.sharding.linear_layer_class), where it takes another nn.Linear subclass too (Llama
    4's router); None where it takes none."""
    # peft matches a target to a module named so, or ending in "." and the target (check_target_module_exists)
    taken = {name: type(module).__name__ for name, module in model.named_modules()
             if (name in expanded or name.rsplit(".", 1)[-1] in expanded) and isinstance(module, nn.Linear | _conv1d())}
    linear = {name for name, kind in taken.items() if linear_layer_class(kind)}
    return None if len(linear) == len(taken) else linear


def _conv1d() -> type:
    from transformers.pytorch_utils import Conv1D

    return Conv1D


def low_dtype(setup) -> torch.dtype | None:
    """The set-up's low-precision dtype (None under fp32)."""
    precision = setup.precision_spec
    return getattr(torch, precision.compute_dtype) if precision.low_precision else None


def collect_after_dora(model: nn.Module, stack: contextlib.ExitStack) -> None:
    """DoRA builds lora_weight = lora_B(lora_A(eye)) every forward and drops its graph unused. On CUDA those
    tensors die by reference counting when DoraLinearLayer.forward returns; under a Python dispatch mode (the
    trace's FakeTensorMode, measure's tracker) they sit in a reference cycle until the garbage collector runs,
    which made both depend on GC timing (checked: an untracked real run frees them at once). Collect right after
    each DoRA forward, where CUDA frees them. The objects alive at the first collection are frozen (gc.freeze), so
    the later full collections only scan the step's new objects."""
    import gc

    if not any(type(m).__name__ == "DoraLinearLayer" for m in model.modules()):
        return
    frozen: list[bool] = []

    def collect(*_) -> None:
        gc.collect()
        if not frozen:
            gc.freeze()
            frozen.append(True)
            stack.callback(gc.unfreeze)

    for module in model.modules():
        if type(module).__name__ == "DoraLinearLayer":
            stack.callback(module.register_forward_hook(collect).remove)


def materialize_prompt_tokens(model: nn.Module, device) -> None:
    """peft's prompt learning keeps its virtual token ids in a plain dict (`prompt_tokens`, torch.arange made at
    get_peft_model): make them on the step's device (fake ones under FakeTensorMode)."""
    tokens = getattr(model, "__dict__", {}).get("prompt_tokens")
    if isinstance(tokens, dict):
        for name, ids in list(tokens.items()):
            tokens[name] = torch.arange(ids.numel(), dtype=ids.dtype, device=device)


def materialize(model: nn.Module, device: torch.device | str, dtype: torch.dtype | None = None) -> None:
    """Replace every meta parameter / buffer by an uninitialised tensor on `device` (a fake one when called under
    FakeTensorMode), keeping tied parameters tied and floating parameters in `dtype` when given."""
    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            new = memo.get(id(p))
            if new is None:
                dt = dtype if (dtype is not None and p.is_floating_point()) else p.dtype
                new = nn.Parameter(torch.empty(p.shape, dtype=dt, device=device), requires_grad=p.requires_grad)
                memo[id(p)] = new
            module._parameters[name] = new
        for name, b in list(module._buffers.items()):
            if b is None:
                continue
            new = memo.get(id(b))
            if new is None:
                new = torch.zeros(b.shape, dtype=b.dtype, device=device)
                memo[id(b)] = new
            module._buffers[name] = new


def init_real_weights(model: nn.Module) -> None:
    """Random initialisation the HF way (normal(0, std) weights, unit norms, recomputed rotary frequencies)."""
    for module in model.modules():
        if hasattr(module, "_is_hf_initialized"):
            module._is_hf_initialized = False
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if hasattr(t, "_is_hf_initialized"):
                t._is_hf_initialized = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.initialize_weights()


def tie_if_needed(model: nn.Module) -> None:
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if out is not None and inp is not None and getattr(model.config, "tie_word_embeddings", False) \
            and out.weight is not inp.weight and tuple(out.weight.shape) == tuple(inp.weight.shape):
        out.weight = inp.weight


def enable_checkpointing(model: nn.Module, every: int = 1, policy: str = "full", encoder_only: bool = False,
                         reentrant: bool = False) -> list[int]:
    """HF activation checkpointing (non-reentrant, or torch's reentrant CheckpointFunction), then switched off on the decoder layers not checkpointed:
    layer i keeps it when i % every == 0, as transformers' `_set_gradient_checkpointing(every_n_layers=...)`
    counts (torchtune's selective option counts from 1: (i + 1) % every == 0). Returns the checkpointed indices.
    A selective policy (--ac-policy op) is torch.utils.checkpoint's `context_fn` (llmem.runtime.selective_ac).
    encoder_only: a vision-language model's encoder blocks alone stay checkpointed, with the hooks transformers
    sets on every input embedding (llmem.learn reads its decoder layers plain under --grad-ckpt)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = {"use_reentrant": reentrant}
        if policy in CONTEXT_FNS:
            kwargs["context_fn"] = CONTEXT_FNS[policy]
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    from transformers.modeling_layers import GradientCheckpointingLayer

    lm = causal_lm(model)        # (a peft model's layers are all inside it; their names within it)
    layers = [(name, m) for name, m in lm.named_modules() if isinstance(m, GradientCheckpointingLayer)]
    if every > 1 and not layers:
        raise LlmemError(f"{type(model).__name__} has no GradientCheckpointingLayer: --grad-ckpt-every needs "
                         "transformers' per-layer checkpointing")
    vision = vision_spec(lm.config.model_type).vision if encoder_only else None
    for i, (name, layer) in enumerate(layers):
        layer.gradient_checkpointing = i % every == 0 and (vision is None or under(name, vision))
    return [i for i, (_, layer) in enumerate(layers) if layer.gradient_checkpointing]


def causal_lm(model: nn.Module) -> nn.Module:
    """The HF *ForCausalLM module inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def install_fused_ce(model: nn.Module) -> None:
    """The step's loss becomes llmem.runtime.losses' fused linear cross-entropy: the causal LM's forward runs its base
    model for the final hidden states and calls the lm_head module, whose forward is the fused loss (so module
    hooks - FSDP2's root unshard, DDP's reducer, the tracer's module tracker - fire as with the plain head).
    The forward is replaced on the instance: peft, DDP and FSDP2 all reach it through `module.forward`."""
    from llmem.runtime.losses import fused_linear_cross_entropy

    lm, head = _loss_owner(model, "--fused-ce")
    if not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise LlmemError(f"--fused-ce needs a causal LM with a linear lm_head; {type(lm).__name__} has none")
    if getattr(text_config(lm.config), "final_logit_softcapping", None):
        raise LlmemError("--fused-ce does not model final_logit_softcapping (Gemma-2)")

    def head_forward(hidden, labels):
        return fused_linear_cross_entropy(hidden, head.weight, getattr(head, "bias", None), labels)

    head.forward = head_forward
    _loss_after_base(lm, "--fused-ce", head)


def install_chunked_output(model: nn.Module, chunks: int, compiled: bool = False, fake: bool = True) -> None:
    """--output-chunks N: the causal LM's forward as torchtune runs its model and loss: the base model's final
    hidden states, TransformerDecoder.chunked_output (the lm_head module called on each of `h.chunk(N, dim=1)`, so
    its hooks fire per chunk), the recipe's shifted labels and CEWithChunkedOutputLoss (llmem.runtime.losses), then
    the recipe's `del logits`; `compiled`: its compute_cross_entropy compiled (llmem.runtime.compile.compile_loss).
    Set on the instance, as install_fused_ce does."""
    from llmem.runtime.losses import CEWithChunkedOutputLoss, torchtune_shifted_labels

    lm, head = _loss_owner(model, "--output-chunks")
    loss_fn = CEWithChunkedOutputLoss(chunks)
    if compiled:        # torchtune's compile flag compiles the loss too (training.compile_loss)
        from llmem.runtime.compile import compile_loss

        compile_loss(loss_fn, fake)

    def chunked_loss(hidden, labels):
        logits = [head(chunk) for chunk in hidden.chunk(chunks, dim=1)]
        del hidden      # (the chunks' own references stay where the lm_head's matmuls save them)
        loss = loss_fn(logits, torchtune_shifted_labels(labels))
        del logits      # the recipe's: "free logits otherwise it peaks backward memory"
        return loss

    _loss_after_base(lm, "--output-chunks", chunked_loss)


def _loss_owner(model: nn.Module, flag: str) -> tuple[nn.Module, nn.Module]:
    """The causal LM whose forward a loss option replaces, and its lm_head module (refused without a base model)."""
    lm = causal_lm(model)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    base = getattr(lm, "base_model", None)
    if head is None or base is None or base is lm:
        raise LlmemError(f"{flag} needs a causal LM with a base model and an lm_head; {type(lm).__name__} has none")
    return lm, head


def _loss_after_base(lm: nn.Module, flag: str, loss_of) -> None:
    """The causal LM's forward, on the instance: its base model's final hidden states handed to `loss_of(hidden,
    labels)` (their only reference: loss_of may drop them), the loss returned as the model output's."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    base = lm.base_model

    def lm_forward(input_ids=None, labels=None, **kwargs):
        kwargs.pop("logits_to_keep", None)
        kwargs.pop("return_dict", None)
        if labels is None:
            raise LlmemError(f"{flag} computes the loss only: the step must pass labels")
        return CausalLMOutputWithPast(loss=loss_of(base(input_ids=input_ids, **kwargs)[0], labels))

    lm.forward = lm_forward


def install_model_dtype_loss(model: nn.Module) -> None:
    """--logits-dtype model: the causal LM's loss_function becomes transformers' ForCausalLMLoss without its
    logits.float() (llmem.runtime.losses.causal_lm_loss_in_model_dtype); set on the instance, which the model's
    forward and the pipeline's loss_fn both read."""
    from llmem.runtime.losses import causal_lm_loss_in_model_dtype

    causal_lm(model).loss_function = causal_lm_loss_in_model_dtype


PACKED_SAMPLES = 2   # --packing: samples per row in the traced step (the mask's size does not depend on it)


def packed_position_ids(batch: int, seq: int, device) -> torch.Tensor:
    """Position ids of rows holding PACKED_SAMPLES samples each (DataCollatorWithFlattening's layout)."""
    per = -(-seq // PACKED_SAMPLES)
    return (torch.arange(seq, device=device) % per).expand(batch, seq).contiguous()


def vocab_size(model: nn.Module) -> int:
    emb = model.get_input_embeddings()
    return int(getattr(emb, "num_embeddings", None) or text_config(model.config).vocab_size)

