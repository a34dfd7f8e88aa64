"""FSDP as the frameworks configure it: accelerate's fsdp_config (fsdp_* keys; axolotl and transformers write the same
keys with or without the prefix) and TrainingArguments' `fsdp` option string. FSDP1 (one FlatParameter per wrapped
unit) is modelled by FSDP2's fully_shard per decoder layer, which is what llmem's fsdp / zero2 run; FULL_SHARD and
reshard_after_forward=True are fsdp, SHARD_GRAD_OP and False are zero2, NO_SHARD is ddp."""

from __future__ import annotations

from llmem.setup.sources.reading import Keys, Reading

STRATEGIES = {"FULL_SHARD": "fsdp", "SHARD_GRAD_OP": "zero2", "NO_SHARD": "ddp", "HYBRID_SHARD": "fsdp",
              "HYBRID_SHARD_ZERO2": "zero2", "1": "fsdp", "2": "zero2", "3": "ddp", "4": "fsdp", "5": "zero2"}
HYBRID_NOTE = ("hybrid sharding (sharded inside a node, replicated across nodes) is modelled as sharding over all "
               "GPUs: exact on one node")
FSDP1_NOTE = "FSDP1 (a FlatParameter per wrapped unit) is modelled by FSDP2's fully_shard per decoder layer"
OFFLOAD_PARAMS_NOTE = "FSDP2's CPUOffloadPolicy: sharded parameters, gradients and the optimizer step on the host"
# keys of the step's memory llmem models the same way whatever they say, or that act at load / save time only
NO_EFFECT = {
    "sync_module_states": "load time only (rank 0's weights broadcast)",
    "use_orig_params": "FSDP1's parameter views: no effect on the step's memory as llmem models it",
    "final_state_dict_type": "the state dict of the final save only",
    "backward_prefetch": "FSDP1's prefetch of the next unit; modelled as FSDP2's default prefetching",
    "forward_prefetch": "FSDP1's prefetch of the next unit; modelled as FSDP2's default prefetching",
    "limit_all_gathers": "FSDP1's rate limiter; modelled as FSDP2's default prefetching",
    "cpu_offload_pin_memory": "pinned host memory: no GPU memory",
    "min_num_params": "size-based wrapping is not modelled (llmem wraps each decoder layer)",
}


def _name(cfg: Keys, name: str) -> str:
    return f"fsdp_{name}" if f"fsdp_{name}" in cfg.data else name


def read_fsdp_config(r: Reading, cfg: Keys, strategy: str | None = None, version: int | None = None) -> None:
    """accelerate's / axolotl's / transformers' fsdp_config into `r`: the method (from the sharding strategy or
    reshard_after_forward), checkpointing, and why the rest is not modelled. `strategy`: a method already told by
    TrainingArguments' `fsdp` string."""
    key = _name(cfg, "version")
    raw_version = cfg.get(key, version or 1)
    version = r.choice(cfg.name(key), raw_version, {"1": 1, "2": 2}, "FSDP has versions 1 and 2")
    if version == 1:
        r.notes.append(FSDP1_NOTE)
    method = strategy or "fsdp"
    for name in ("sharding_strategy", "reshard_after_forward"):
        k = _name(cfg, name)
        if k not in cfg:
            continue
        raw = cfg.get(k)
        if isinstance(raw, bool):
            method = "fsdp" if raw else "zero2"
        else:
            method = r.choice(cfg.name(k), raw, STRATEGIES, "choose FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or "
                              "HYBRID_SHARD (FSDP2: true or false)")
            if "HYBRID" in str(raw).upper() or str(raw) in ("4", "5"):
                r.notes.append(HYBRID_NOTE)
        r.note_used(cfg.name(k), raw, f"method {method}")
    r.method = method
    # accelerate upcasts low-precision trained parameters to fp32 under mixed precision (fsdp_utils
    # fsdp2_prepare_model; Accelerator.prepare_model for FSDP1's FlatParameter), MixedPrecision casting for compute
    r.dtype(masters=True)
    k = _name(cfg, "offload_params")
    if k in cfg and r.boolean(cfg.name(k), cfg.get(k)):
        r.set(cfg.name(k), True, "offload_param", True, OFFLOAD_PARAMS_NOTE)
    k = _name(cfg, "activation_checkpointing")
    if k in cfg and r.boolean(cfg.name(k), cfg.get(k)):
        r.set(cfg.name(k), True, "grad_ckpt", True, "FSDP's activation checkpointing of each decoder layer")
    k = _name(cfg, "auto_wrap_policy")
    if k in cfg:
        policy = str(cfg.get(k)).upper()
        if policy == "TRANSFORMER_BASED_WRAP":
            r.note_used(cfg.name(k), cfg.get(k), "a unit per decoder layer, as llmem's fsdp wraps")
        else:
            r.ignore(cfg.name(k), cfg.get(k), "llmem wraps each decoder layer (TRANSFORMER_BASED_WRAP)")
    k = _name(cfg, "transformer_layer_cls_to_wrap")
    if k in cfg:
        r.note_used(cfg.name(k), cfg.get(k), "the decoder layer: llmem's unit")
    k = _name(cfg, "mixed_precision_policy")
    if k in cfg:
        r.ignore(cfg.name(k), cfg.get(k), "FSDP's precision follows the trainer's bf16 / fp16 (llmem's *-mixed: "
                 "bf16 gathers, fp32 reductions)", approximates=False)
    if method in ("fsdp", "zero2"):      # the job's phases (llmem.setup.job_phases): FSDP2's loading and saving
        _read_phases(r, cfg)
    for name, why in NO_EFFECT.items():
        k = _name(cfg, name)
        if k in cfg:
            r.ignore(cfg.name(k), cfg.get(k), why, approximates=name == "min_num_params")
    for name in ("activation_cpu_offload", "offload_policy"):
        k = _name(cfg, name)
        if k in cfg:
            r.ignore(cfg.name(k), cfg.get(k), "not modelled")


# accelerate's fsdp_state_dict_type -> llmem's --save-kind (FSDP1's LOCAL_STATE_DICT: each rank its own shards too)
SAVE_KINDS = {"FULL_STATE_DICT": "full", "SHARDED_STATE_DICT": "sharded", "LOCAL_STATE_DICT": "sharded"}


def _read_phases(r: Reading, cfg: Keys) -> None:
    """cpu_ram_efficient_loading (accelerate's one host copy per node) -> --load-path cpu-ram-efficient;
    state_dict_type -> --save-kind."""
    k = _name(cfg, "cpu_ram_efficient_loading")
    if k in cfg:
        on = r.boolean(cfg.name(k), cfg.get(k))
        r.set(cfg.name(k), cfg.get(k), "load_path", "cpu-ram-efficient" if on else "cpu",
              "rank 0 loads, the others receive each parameter" if on else "every rank loads the model")
    k = _name(cfg, "state_dict_type")
    if k in cfg:
        kind = r.choice(cfg.name(k), cfg.get(k), SAVE_KINDS, "choose FULL_STATE_DICT or SHARDED_STATE_DICT")
        r.set(cfg.name(k), cfg.get(k), "save_kind", kind)


def strategy_from_options(r: Reading, key: str, raw) -> str | None:
    """TrainingArguments' `fsdp` (a string "full_shard auto_wrap" or a list): the method it names, or None when it
    is empty / False."""
    if raw in (None, False, "", []):
        return None
    words = raw.split() if isinstance(raw, str) else [str(w) for w in raw]
    method = None
    for w in words:
        word = w.lower()
        if word in ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"):
            method = STRATEGIES[word.upper()]
            if word.startswith("hybrid"):
                r.notes.append(HYBRID_NOTE)
        elif word == "offload":
            r.set(key, "offload", "offload_param", True, OFFLOAD_PARAMS_NOTE)
        elif word != "auto_wrap":
            raise r.error(key, raw, f"names an FSDP option {w!r} transformers does not know",
                          "use full_shard, shard_grad_op, hybrid_shard, no_shard, offload, auto_wrap")
    method = method or "fsdp"
    r.note_used(key, raw, f"method {method}")
    return method
