"""torchtitan's train-config TOML, in its two schemas: [training] local_batch_size / seq_len with [parallelism]
(2025-2026, until the TOMLs gave way to Python presets) and the older one with batch_size and the parallel degrees
under [training] ([experimental] for pipeline / context parallel).

torchtitan shards with FSDP2 (data_parallel_shard_degree, -1: every remaining GPU) under MixedPrecisionPolicy
(mixed_precision_param bfloat16, mixed_precision_reduce float32 by default: llmem's fsdp bf16-mixed), and
tensor_parallel_degree > 1 adds TP (fsdp+tp). Its AdamW is torch's, fused by default (implementation "fused");
[activation_checkpoint] mode full checkpoints every block, selective with an integer option every N-th, with "op"
torchtitan's op-level policy (--ac-policy op). pipeline_parallel_degree > 1 is llmem's --pp under single or fsdp
(data_parallel_shard_degree > 1), its schedule, micro-batch size and layers per stage read back to --pp-schedule,
--pp-microbatches and --pp-virtual-stages (the inverse of llmem.setup.pipeline.torchtitan_pipeline)."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

from llmem.setup.float8 import FLOAT8_RECIPES
from llmem.setup.pipeline import (
    FIRST_STAGE_LESS_LAYERS,
    LAST_STAGE_LESS_LAYERS,
    LOOPED_METHODS,
    PIPELINE_SCHEDULES,
    PipelineScheduleSpec,
)
from llmem.setup.sources.deepspeed import GA_NOTE
from llmem.setup.sources.reading import Keys, Reading

TORCHTITAN_VERSION = "0.3.0"     # the torchtitan whose flavors torchtitan_flavors.json holds


@cache
def flavors() -> dict[tuple[str, str], dict]:
    """(model name, flavor), lower-cased -> its row: the dimensions torchtitan's own source gives the flavor and the
    catalog model with the same ones (tools/make_torchtitan_flavors.py), and torchtitan's llama2 (dropped in 0.3)
    as Meta's configs."""
    rows = json.loads(resources.files(__package__).joinpath("torchtitan_flavors.json").read_text())["flavors"]
    table = {tuple(key.lower().split("/", 1)): row for key, row in rows.items()}
    return table | {("llama2", size): {"hub_id": hub, "dims": {"num_hidden_layers": layers}}
                    for size, (hub, layers) in LLAMA2_FLAVORS.items()}


LLAMA2_FLAVORS = {"7b": ("meta-llama/Llama-2-7b-hf", 32), "13b": ("meta-llama/Llama-2-13b-hf", 40),
                  "70b": ("meta-llama/Llama-2-70b-hf", 80)}
# the families --export torchtitan writes (its TOML's [model] section as llama3 / llama2 take it)
EXPORTED_MODELS = ("llama3", "llama2")
FLAVORS = {key: row["hub_id"] for key, row in flavors().items() if key[0] in EXPORTED_MODELS and row["hub_id"]}
# torchtitan's n_layers of each catalog model a flavor names, which its pipeline split counts
# (_get_pipeline_metadata)
FLAVOR_LAYERS = {row["hub_id"]: row["dims"]["num_hidden_layers"] for row in flavors().values() if row["hub_id"]}
IMPLEMENTATIONS = {"fused": "adamw-fused", "foreach": "adamw", "for-loop": "adamw-forloop"}
PRECISION = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# torch's get_schedule_class names, lower-cased (it matches case-insensitively) -> llmem's schedule rows
TORCHTITAN_SCHEDULES = {spec.torchtitan_name.lower(): spec for spec in PIPELINE_SCHEDULES.values()}
PIPELINE_KEYS = ("pipeline_parallel_schedule", "pipeline_parallel_microbatch_size",
                 "pipeline_parallel_layers_per_stage", "pipeline_parallel_first_stage_less_layers",
                 "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_schedule_csv",
                 "module_fqns_per_model_part")
OTHER_DEGREES = {"TP": "tensor_parallel_degree", "HSDP": "data_parallel_replicate_degree",
                 "DDP": "data_parallel_replicate_degree"}


def detect(data: dict) -> bool:
    return isinstance(data.get("training"), dict) and isinstance(data.get("model"), dict) and \
        ("job" in data or "parallelism" in data or "seq_len" in data["training"])


def read(keys: Keys, r: Reading) -> None:
    r.multi_gpu_method = "fsdp"
    training = keys.sub("training")
    new = "parallelism" in keys.data or "local_batch_size" in training.data
    old = any(k in training.data for k in ("batch_size", "data_parallel_shard_degree", "tensor_parallel_degree"))
    if not new and not old:
        raise r.error("training", "...", "has neither local_batch_size ([parallelism] schema) nor batch_size (the "
                      "older schema): an unknown torchtitan version", "give a torchtitan train config TOML")
    parallel = keys.sub("parallelism") if new else training
    _model(r, keys.sub("model"))
    batch_key = "local_batch_size" if "local_batch_size" in training else "batch_size"
    batch = training.get(batch_key, 8)
    r.set(f"training.{batch_key}" + ("" if batch_key in training else " (default)"), batch, "batch_size",
          r.integer(f"training.{batch_key}", batch, what="a micro-batch"))
    seq = training.get("seq_len", 2048)
    r.set("training.seq_len", seq, "seq_len", r.integer("training.seq_len", seq, what="a sequence length"))
    if "global_batch_size" in training:
        r.note_used("training.global_batch_size", training.get("global_batch_size"), f"gradient accumulation; {GA_NOTE}")
    _parallelism(r, parallel, keys.sub("experimental"), "training." if old else "parallelism.")
    _precision(r, training)
    _optimizer(r, keys.sub("optimizer"))
    _checkpointing(r, keys.sub("activation_checkpoint"))
    _compile(r, keys.sub("compile"), training)
    if training.get("enable_cpu_offload"):
        r.set("training.enable_cpu_offload", True, "offload_param", True, "FSDP2's CPUOffloadPolicy")
    _float8(r, keys)
    for section in ("job", "profiling", "metrics", "checkpoint", "lr_scheduler", "validation", "quantize",
                    "float8", "comm", "memory_estimation"):
        keys.sub(section)
    for key in ("warmup_steps", "max_norm", "steps", "dataset", "dataset_path", "seed", "deterministic",
                "gc_freq"):
        training.get(key)
    r.not_read(keys)


# model.converters naming torchao's Float8Linear: "float8" (torchtitan 0.1, its [float8] section; later TOMLs keep the
# name with a [quantize.linear.float8] section) or "quantize.linear.float8" (0.2)
FLOAT8_CONVERTERS = ("float8", "quantize.linear.float8")
# filter_fqns entries llmem's filter has already: torchtitan's output projection (HF's lm_head, never converted)
FLOAT8_FILTERED = ("output",)


def _float8(r: Reading, keys: Keys) -> None:
    """torchtitan's Float8LinearConverter (components/quantization/float8.py, 0.2): recipe_name unset is torchao's
    default tensorwise config, with enable_fsdp_float8_all_gather where FSDP2 shards (dp_shard_enabled); a
    recipe_name is Float8LinearConfig.from_recipe_name (torchtitan asserts no float8 all-gather with it); its filter
    skips any linear whose fqn contains a filter_fqns entry or whose dims are not multiples of 16."""
    model = keys.sub("model")
    converters = model.get("converters") or []
    converters = [converters] if isinstance(converters, str) else list(converters)
    named = [c for c in converters if c in FLOAT8_CONVERTERS]
    others = [c for c in converters if c not in FLOAT8_CONVERTERS]
    if others:
        r.ignore("model.converters", others, "these converters (MX formats, ...) are not modelled: bf16 linears "
                 "stand in")
    config = keys.sub("quantize").sub("linear").sub("float8")    # the section moved before the converter's name
    config = config if config.data else keys.sub("float8")
    if not named and not config.get("enable_float8_linear"):
        return
    recipe = config.get("recipe_name")
    r.set("model.converters", named or "[float8] enable_float8_linear", "float8",
          r.choice(config.name("recipe_name"), recipe, tuple(FLOAT8_RECIPES)) if recipe else "tensorwise",
          "torchao's Float8Linear" + ("" if recipe else " (no recipe_name: torchao's tensorwise default)"))
    gather = config.get("enable_fsdp_float8_all_gather", False)
    if gather and recipe is None and r.method in ("fsdp", "fsdp+tp", "zero2"):
        r.set(config.name("enable_fsdp_float8_all_gather"), gather, "float8_all_gather", True,
              "FSDP2 all-gathers the float8 weights")
    elif gather:
        r.ignore(config.name("enable_fsdp_float8_all_gather"), gather, "torchtitan applies it only to tensorwise "
                 "scaling under FSDP2", approximates=False)
    if config.get("precompute_float8_dynamic_scale_for_fsdp"):
        r.note_used(config.name("precompute_float8_dynamic_scale_for_fsdp"), True, "one fp32 scale per weight "
                    "after the optimizer step: bytes llmem leaves out")
    _float8_filter(r, config)
    config.get("emulate")


def _float8_filter(r: Reading, config: Keys) -> None:
    """filter_fqns as llmem's filter reads it (llmem.setup.float8.converted): the output projection is never
    converted; other entries are not expressed."""
    fqns = list(config.get("filter_fqns") or [])
    if not any(f in fqns for f in FLOAT8_FILTERED):
        r.ignore(config.name("filter_fqns"), fqns, "the output projection converted to float8 (no \"output\" in "
                 "filter_fqns) is not modelled: llmem keeps it in bf16")
    rest = [f for f in fqns if f not in FLOAT8_FILTERED]
    if rest:
        r.ignore(config.name("filter_fqns"), rest, "these linears left in bf16 are not expressed: llmem converts "
                 "every decoder linear whose dims are multiples of 16")


def _model(r: Reading, model: Keys) -> None:
    name, flavor = str(model.get("name", "")), str(model.get("flavor", ""))
    row = flavors().get((name.lower(), flavor.lower()))
    if row is not None and row["hub_id"]:
        r.set("model.name + flavor", f"{name} {flavor}", "model", row["hub_id"], "the same dimensions")
    else:
        why = f"is not a flavor of torchtitan {TORCHTITAN_VERSION}" if row is None else \
            "has dimensions no catalog model has"
        r.ignore("model.name + flavor", f"{name} {flavor}", f"{why}: give MODEL on the command line")
    for key in ("hf_assets_path", "tokenizer_path", "norm_type"):
        model.get(key)


def _parallelism(r: Reading, p: Keys, experimental: Keys, prefix: str) -> None:
    def degree(keys: Keys, name: str, default: int) -> int:
        raw = keys.get(name, default)
        return -1 if raw == -1 else r.integer(f"{keys.prefix or prefix}{name}", raw, what="a parallel degree")

    shard = degree(p, "data_parallel_shard_degree", -1)
    replicate = degree(p, "data_parallel_replicate_degree", 1)
    tp = degree(p, "tensor_parallel_degree", 1)
    pp = degree(p if "pipeline_parallel_degree" in p else experimental, "pipeline_parallel_degree", 1)
    cp = degree(p if "context_parallel_degree" in p else experimental, "context_parallel_degree", 1)
    # torchtitan shards with FSDP2 when data_parallel_shard_degree > 1 (-1: the rest), replicates alone (DDP's
    # replicate()) when only data_parallel_replicate_degree is > 1; TP on its own mesh dimension
    sharded = shard != 1
    r.shard_rest = shard == -1
    r.method = ("fsdp+tp" if sharded else "tp") if tp > 1 else ("fsdp" if sharded else
                                                                "ddp" if replicate > 1 else "single")
    r.note_used(f"{prefix}data_parallel_shard_degree", shard, "no FSDP2" if not sharded else "FSDP2 over " +
                ("every remaining GPU" if shard == -1 else f"{shard} GPUs"))
    if tp > 1:
        r.set(f"{prefix}tensor_parallel_degree", tp, "tp", tp)
        # parallelize_llama's TP plan: SequenceParallel norms always, the loss on vocab-sharded logits under
        # loss_parallel() unless disable_loss_parallel
        r.set(f"{prefix}tensor_parallel_degree", tp, "sequence_parallel", True, "torchtitan's TP is sequence parallel")
        no_loss_parallel = r.boolean(f"{prefix}disable_loss_parallel", p.get("disable_loss_parallel", False))
        r.set(f"{prefix}disable_loss_parallel", no_loss_parallel, "loss_parallel", not no_loss_parallel)
    if shard > 0 and min(replicate, pp, cp) > 0:
        r.gpus = shard * replicate * tp * pp * cp
        r.note_used(f"{prefix}(degrees)", f"{shard} x {replicate} x {tp} x {pp} x {cp}", f"gpus = {r.gpus}")
    if replicate > 1 and sharded:
        r.set(f"{prefix}data_parallel_replicate_degree", replicate, "dp_replicate", replicate,
              "HSDP: FSDP2 shards within each replica")
    elif replicate > 1 and tp > 1:
        raise r.error(f"{prefix}data_parallel_replicate_degree", replicate, "replicates a TP model without sharding "
                      "(DDP x TP), which llmem has no method for", "shard it (data_parallel_shard_degree > 1)")
    elif replicate > 1:
        r.note_used(f"{prefix}data_parallel_replicate_degree", replicate, "replicas without sharding: ddp")
    _pipeline(r, p if "pipeline_parallel_degree" in p else experimental, pp,
              ["DDP"] if replicate > 1 and not sharded else [])    # HSDP x PP, TP x PP: modelled
    if cp > 1 and r.method == "fsdp" and pp == 1 and replicate == 1:   # llmem.setup.context_parallel's layout
        r.set(f"{prefix}context_parallel_degree", cp, "cp", cp, "torch's ring attention, FSDP2 over dp_shard x cp")
    elif cp > 1:
        r.ignore("context_parallel_degree", cp, "context parallelism is modelled under FSDP2 alone (no TP, PP or "
                 "HSDP): the whole sequence per GPU")
    ep = degree(p, "expert_parallel_degree", 1)     # borrows from dp_shard: not in the GPU count
    if ep > 1 and r.method == "fsdp" and pp == 1 and replicate == 1 and cp == 1:   # llmem.setup.expert_parallel
        r.set(f"{prefix}expert_parallel_degree", ep, "ep", ep, "the routed experts over ep of the FSDP2 ranks, "
              "efsdp x ep")
    elif ep > 1:
        r.ignore("expert_parallel_degree", ep, "expert parallelism is modelled under FSDP2 alone (no TP, PP, CP or "
                 "HSDP): every expert per GPU")
    if p.get("enable_async_tensor_parallel"):
        r.ignore(f"{prefix}enable_async_tensor_parallel", True, "async TP's overlapped buffers are not modelled")
    for key in ("fsdp_reshard_after_forward",):
        if key in p and str(p.get(key)).lower() == "never" and pp > 1:     # fsdp.py: PP's default already
            r.note_used(f"{prefix}{key}", "never", "torchtitan's default under PP (no reshard between micro-batches)")
        elif key in p and str(p.get(key)).lower() == "always" and pp > 1:
            r.ignore(f"{prefix}{key}", "always", "resharding between pipeline micro-batches is not modelled: "
                     "torchtitan's PP default (gathered from the first forward to the last backward) stands in")
        elif key in p and str(p.get(key)).lower() == "never":
            r.method = "zero2" if r.method == "fsdp" else r.method
            r.note_used(f"{prefix}{key}", "never", f"method {r.method}")
    for key in ("enable_compiled_autograd", "pipeline_parallel_schedule", "disable_loss_parallel"):
        p.get(key)


def _pipeline(r: Reading, s: Keys, pp: int, others: list[str]) -> None:
    """torchtitan's pipeline_llm (distributed/pipeline_parallel.py), the inverse of llmem.setup.pipeline's
    torchtitan_pipeline: pipeline_parallel_degree ranks running pipeline_parallel_schedule (torch's
    get_schedule_class, case-insensitive) over local_batch_size / pipeline_parallel_microbatch_size micro-batches
    (build_pipeline_schedule), and _get_pipeline_metadata's stages: ceil((n_layers + first_less + last_less) /
    pipeline_parallel_layers_per_stage) in all, a whole number per rank (default 1, 2 under a looped schedule)."""
    if pp == 1:
        for key in PIPELINE_KEYS:
            s.get(key)
        return
    degree = s.name("pipeline_parallel_degree")
    if others:
        raise r.error(degree, pp, f"pipelines a {' x '.join(others)} model, which llmem does not model (pipeline "
                      "stages run alone, under FSDP2 / HSDP and / or TP)",
                      "drop " + " / ".join(OTHER_DEGREES[o] for o in others) +
                      " or set pipeline_parallel_degree = 1")
    r.set(degree, pp, "pp", pp, "torch.distributed.pipelining: the decoder split into pp stages" +
          {"fsdp": ", FSDP2 within each", "tp": ", TP within each", "fsdp+tp": ", FSDP2 x TP within each"}.get(
              r.method, ""))
    spec = _schedule(r, s)
    _microbatches(r, s)
    _stages_per_rank(r, s, pp, spec)
    if s.get("module_fqns_per_model_part"):
        r.ignore(s.name("module_fqns_per_model_part"), "...", "a hand-placed split is not modelled: torchtitan's "
                 "even split (_generate_llm_fqn_per_model_part) stands in")


def _schedule(r: Reading, s: Keys) -> PipelineScheduleSpec:
    key = s.name("pipeline_parallel_schedule")
    raw = s.get("pipeline_parallel_schedule", "1F1B")
    if s.get("pipeline_parallel_schedule_csv"):
        raise r.error(s.name("pipeline_parallel_schedule_csv"), s.get("pipeline_parallel_schedule_csv"),
                      "runs a schedule from a CSV (_PipelineScheduleRuntime), which llmem does not model",
                      "drop it and choose pipeline_parallel_schedule 1F1B, GPipe or Interleaved1F1B")
    spec = TORCHTITAN_SCHEDULES.get(str(raw).lower())
    if spec is None or not spec.modelled:
        why = f"({spec.torch_class}) {spec.not_modelled_why}" if spec else "is not a schedule llmem knows"
        raise r.error(key, raw, why, "choose 1F1B, GPipe or Interleaved1F1B")
    if spec.looped and r.method not in LOOPED_METHODS:      # llmem.setup.pipeline.check_schedule_method
        raise r.error(key, raw, "under FSDP2 (data_parallel_shard_degree > 1) runs FSDP2 over several stages per "
                      "rank, which llmem does not model yet", "choose 1F1B or GPipe, or data_parallel_shard_degree = 1")
    r.set(key + ("" if "pipeline_parallel_schedule" in s else " (default)"), raw, "pp_schedule", spec.name,
          f"torch's {spec.torch_class}")
    return spec


def _microbatches(r: Reading, s: Keys) -> None:
    key = s.name("pipeline_parallel_microbatch_size")
    raw = s.get("pipeline_parallel_microbatch_size", 1)
    size = r.integer(key, raw, what="a micro-batch size")
    batch = r.values["batch_size"]
    if batch % size:          # build_pipeline_schedule's check
        raise r.error(key, raw, f"does not divide training.local_batch_size {batch} (torchtitan refuses it)",
                      "choose a divisor of local_batch_size")
    if size == 1:             # llmem's default too: one sample per micro-batch
        r.note_used(key + ("" if "pipeline_parallel_microbatch_size" in s else " (default)"), raw,
                    f"{batch} micro-batches of 1 sample (local_batch_size / 1)")
    else:
        r.set(key, raw, "pp_microbatches", batch // size, f"local_batch_size {batch} / {size}")


def _stages_per_rank(r: Reading, s: Keys, pp: int, spec: PipelineScheduleSpec) -> None:
    first = r.integer(s.name("pipeline_parallel_first_stage_less_layers"),
                      s.get("pipeline_parallel_first_stage_less_layers", FIRST_STAGE_LESS_LAYERS), low=0)
    last = r.integer(s.name("pipeline_parallel_last_stage_less_layers"),
                     s.get("pipeline_parallel_last_stage_less_layers", LAST_STAGE_LESS_LAYERS), low=0)
    if (first, last) != (FIRST_STAGE_LESS_LAYERS, LAST_STAGE_LESS_LAYERS):
        r.ignore(s.name("pipeline_parallel_*_stage_less_layers"), f"{first}, {last}", "llmem splits with "
                 "torchtitan's default (the embedding and the head count one layer each)")
    key = s.name("pipeline_parallel_layers_per_stage")
    if "pipeline_parallel_layers_per_stage" not in s:     # torchtitan's default: llmem's --pp-virtual-stages default
        return
    per = r.integer(key, s.get("pipeline_parallel_layers_per_stage"), what="a layer count")
    layers = FLAVOR_LAYERS.get(r.values.get("model", ""))
    if layers is None:
        raise r.error(key, per, "needs the model's layer count, and the file names no torchtitan flavor llmem "
                      "knows", "drop it (torchtitan's default stages per rank) or give a llama3 / llama2 flavor")
    stages = -(-(layers + first + last) // per)
    made = f"makes ceil(({layers} + {first} + {last}) / {per}) = {stages} stages"
    if stages % pp:
        raise r.error(key, per, f"{made}, not a whole number per rank of pipeline_parallel_degree {pp} (torchtitan "
                      "refuses it)", "choose layers per stage giving a multiple of the degree")
    v = stages // pp
    if (not spec.looped and v != 1) or (spec.looped and v < 2):
        raise r.error(key, per, f"{made}, {v} per rank, but {spec.torch_class} runs "
                      + ("1" if not spec.looped else "at least 2"), "choose layers per stage to match the schedule")
    if spec.looped:
        r.set(key, per, "pp_virtual_stages", v, f"{made}: {v} per rank")
    else:
        r.note_used(key, per, f"{made}: 1 per rank")


def _precision(r: Reading, training: Keys) -> None:
    """FSDP2's MixedPrecisionPolicy(param_dtype=mixed_precision_param, reduce_dtype=mixed_precision_reduce) over
    fp32 parameters; without FSDP2 under TP or PP, training.dtype (maybe_enable_amp)."""
    r.no_fsdp_precision = _training_dtype(training)
    if r.method == "tp" or (r.method == "single" and r.values.get("pp", 1) > 1):     # no FSDP2 (TP x PP too)
        _no_fsdp_precision(r, training)
        return
    raw = training.get("mixed_precision_param", "bfloat16")
    compute = r.choice("training.mixed_precision_param", raw, PRECISION)
    r.note_used("training.mixed_precision_param" + ("" if "mixed_precision_param" in training else " (default)"),
                raw, "FSDP2 gathers and computes in it, fp32 parameters")
    r.dtype(compute=compute, weights="fp32", masters=True)
    reduce = training.get("mixed_precision_reduce", "float32")
    if str(reduce) != "float32":
        r.ignore("training.mixed_precision_reduce", reduce, "llmem's *-mixed reduces in fp32")


# training.dtype, the dtype torchtitan builds and trains the model in where no FSDP2 mixed precision applies
TRAINING_DTYPES = {"bfloat16": "bf16", "float32": "fp32"}


def _training_dtype(training: Keys) -> str:
    return TRAINING_DTYPES.get(str(training.data.get("dtype", "float32")), "fp32")


def _no_fsdp_precision(r: Reading, training: Keys) -> None:
    """TP or PP without FSDP2: torchtitan autocasts under DDP or one GPU alone (maybe_enable_amp: "Mixed precision
    training with TP or PP is only supported when FSDP/HSDP/CP is enabled"; 0.3's TrainingConfig.
    mixed_precision_param docstring), so mixed_precision_param takes no effect: the model trains in training.dtype
    (float32 by default; trainer.py's set_default_dtype), fp32 or pure bf16."""
    raw = training.get("dtype", "float32")
    dtype = r.choice("training.dtype", raw, TRAINING_DTYPES)
    r.note_used("training.dtype" + ("" if "dtype" in training else " (default)"), raw,
                "TP or PP without FSDP2 trains in it (no FSDP2 mixed precision, no autocast)")
    if "mixed_precision_param" in training:
        r.note_used("training.mixed_precision_param", training.get("mixed_precision_param"),
                    "no effect without FSDP2 under TP or PP")
    training.get("mixed_precision_reduce")
    r.dtype(compute=dtype, weights=dtype, masters=False)


def _optimizer(r: Reading, opt: Keys) -> None:
    name = str(opt.get("name", "AdamW"))
    impl = str(opt.get("implementation", "fused"))
    for key in ("lr", "eps", "weight_decay", "beta1", "beta2"):
        opt.get(key)
    if name.lower() not in ("adamw", "adam"):
        r.ignore("optimizer.name", name, "not in llmem's optimizer registry: llmem's optimizer stands in")
        return
    if impl not in IMPLEMENTATIONS:
        raise r.error("optimizer.implementation", impl, "is not a torch implementation", "choose fused, foreach or "
                      "for-loop")
    r.set("optimizer.name + implementation", f"{name} {impl}", "optimizer", IMPLEMENTATIONS[impl],
          "" if "implementation" in opt else "torchtitan's default implementation: fused")


def _compile(r: Reading, section: Keys, training: Keys) -> None:
    """[compile] enable and components (torchtitan's default: the model and the loss; before it, training.compile:
    both): the model's blocks compiled one by one (apply_compile), after activation checkpointing wraps them."""
    if not section.get("enable", training.get("compile", False)):
        return
    components = section.get("components", ["model", "loss"])
    if "model" in components:
        order = ("; torchtitan compiles each block with its checkpoint inside the graph, llmem inside the "
                 "checkpoint (torchtune's order): the same saved inputs, the recompute's transients may differ"
                 if r.values.get("grad_ckpt") else "")
        r.set("compile.enable", True, "compile", True, "each block compiled (apply_compile)" + order)
    if "loss" in components:
        r.ignore("compile.components", components, "the loss compiled: not modelled (it runs eagerly in the "
                 "estimate)")


def _checkpointing(r: Reading, ac: Keys) -> None:
    mode = str(ac.get("mode", "selective")).lower()
    if mode == "full":
        r.set("activation_checkpoint.mode", mode, "grad_ckpt", True)
    elif mode == "selective":
        option = str(ac.get("selective_ac_option", "2"))
        if option.isdigit() and int(option) >= 1:
            r.set("activation_checkpoint.selective_ac_option", option, "ckpt_every", int(option),
                  "every N-th block checkpointed")
            r.values["grad_ckpt"] = True
        elif option == "op":     # _apply_op_sac: llmem's --ac-policy op (llmem.runtime.selective_ac)
            r.set("activation_checkpoint.selective_ac_option", option, "ac_policy", "op",
                  "op-level selective checkpointing: every other matmul and the SDPA outputs saved")
            r.values["grad_ckpt"] = True
        else:
            r.ignore("activation_checkpoint.selective_ac_option", option, "not a torchtitan option (an integer or "
                     "op): estimated without checkpointing")
    elif mode != "none":
        raise r.error("activation_checkpoint.mode", mode, "is not a torchtitan checkpointing mode",
                      "choose none, selective or full")
    for key in ("per_op_sac_force_recompute_mm_shapes_by_fqns", "early_stop", "memory_budget"):
        ac.get(key)
