"""accelerate's config YAML (`accelerate config` / `accelerate launch --config_file`): distributed_type, the process
count, mixed_precision, fsdp_config, deepspeed_config (its own keys, or a deepspeed_config_file beside it) and
parallelism_config.

mixed_precision is autocast over the weights the script loads; llmem assumes the script loads fp32 (accelerate's
own examples do), so bf16 reads as bf16-mixed. Under FSDP accelerate upcasts low-precision trained parameters to
fp32 itself (fsdp_utils.fsdp2_prepare_model / Accelerator.prepare_model), and DeepSpeed keeps fp32 master partitions:
bf16-mixed either way. A training config given with it (--from both) says what the script loads."""

from __future__ import annotations

from llmem.setup.methods import METHODS
from llmem.setup.sources.deepspeed import GA_NOTE, STAGE_METHODS, STAGE_NOTES, TrainerValues, read_deepspeed
from llmem.setup.sources.files import find_reference, load
from llmem.setup.sources.fsdp import read_fsdp_config
from llmem.setup.sources.reading import Keys, Reading

DISTRIBUTED = ("NO", "MULTI_GPU", "FSDP", "DEEPSPEED")
MIXED = {"no": "fp32", "fp16": "fp16", "bf16": "bf16", "fp8": "bf16"}


def detect(data: dict) -> bool:
    return "distributed_type" in data or ("compute_environment" in data and "num_processes" in data)


def read(keys: Keys, r: Reading) -> None:
    kind = str(keys.get("distributed_type", "NO")).upper()
    if kind not in DISTRIBUTED:
        raise r.error("distributed_type", keys.get("distributed_type"), "is not modelled (llmem models single, "
                      "DDP, FSDP and DeepSpeed GPU runs)", "use NO, MULTI_GPU, FSDP or DEEPSPEED")
    processes = r.integer("num_processes", keys.get("num_processes", 1), what="a process count")
    machines = r.integer("num_machines", keys.get("num_machines", 1), what="a machine count")
    if keys.get("use_cpu"):
        raise r.error("use_cpu", True, "runs on the CPU", "llmem estimates GPU memory: set use_cpu false")
    mixed = str(keys.get("mixed_precision", "no")).lower()
    compute = r.choice("mixed_precision", mixed, MIXED)
    r.note_used("mixed_precision", mixed, "autocast" if compute != "fp32" else "fp32")
    if mixed == "fp8":
        # torchao's backend (accelerate.utils.ao.convert_model_to_fp8_ao) converts every nn.Linear but the model's
        # first and last, under bf16 autocast (native_amp): llmem's --float8 is modelled over bf16 weights only
        r.ignore("mixed_precision", "fp8", "fp8 training is not modelled here (Transformer Engine / MS-AMP; "
                 "torchao's Float8Linear runs under bf16 autocast and leaves the first linear in bf16, which "
                 "--float8 does not express): bf16 autocast stands in")
    r.dtype(compute=compute, weights="fp32")
    if kind == "NO":
        r.method, r.gpus = "single", 1
        r.note_used("distributed_type", kind, "method single")
        if processes > 1:
            r.ignore("num_processes", processes, "distributed_type NO launches one process (accelerate's "
                     "simple_launcher)", approximates=False)
    else:
        r.gpus = processes
        r.note_used("num_processes", processes, f"gpus = {processes}")
        if machines > 1:
            if processes % machines:
                raise r.error("num_processes", processes, f"is not a whole number of processes per machine over "
                              f"{machines} machines", f"give a multiple of {machines}")
            r.gpus_per_node = processes // machines
            r.note_used("num_machines", machines, f"gpus_per_node = {processes // machines}")
    if kind == "MULTI_GPU":
        r.method = "ddp"
        r.note_used("distributed_type", kind, "method ddp")
    elif kind == "FSDP":
        r.note_used("distributed_type", kind, "FSDP")
        read_fsdp_config(r, keys.sub("fsdp_config"))
        if compute != "fp32":
            r.dtype(masters=True)
    elif kind == "DEEPSPEED":
        _deepspeed(r, keys, keys.sub("deepspeed_config"), processes, compute)
    else:
        keys.sub("fsdp_config")
    _parallelism(r, keys.sub("parallelism_config"))
    for key in ("machine_rank", "main_training_function", "rdzv_backend", "same_network", "tpu_env",
                "tpu_use_cluster", "tpu_use_sudo", "compute_environment", "debug", "gpu_ids", "downcast_bf16",
                "enable_cpu_affinity", "main_process_ip", "main_process_port", "fp8_config", "dynamo_config"):
        keys.get(key)
    r.not_read(keys)


def _deepspeed(r: Reading, keys: Keys, ds: Keys, processes: int, compute: str) -> None:
    """DeepSpeedPlugin (accelerate/utils/dataclasses.py): a deepspeed_config_file, or the config accelerate builds
    from zero_stage (default 2), offload_optimizer_device, offload_param_device and gradient_accumulation_steps."""
    accum = ds.get("gradient_accumulation_steps")
    trainer = TrainerValues("accelerate", None, accum if isinstance(accum, int) else None, processes,
                            compute == "bf16", compute == "fp16")
    if "deepspeed_config_file" in ds:
        ref = str(ds.get("deepspeed_config_file"))
        path = find_reference(ref, r.path, "deepspeed_config.deepspeed_config_file")
        _, data = load(path)
        r.files.append((str(path), "deepspeed"))
        r.note_used("deepspeed_config.deepspeed_config_file", ref, f"read {path}")
        read_deepspeed(r, data, path.name, trainer)
    else:
        stage = r.choice("deepspeed_config.zero_stage", ds.get("zero_stage", 2), {str(s): s for s in STAGE_METHODS})
        r.method, r.zero_stage = STAGE_METHODS[stage], stage
        r.note_used("deepspeed_config.zero_stage", stage, f"method {r.method}")
        r.notes.append(STAGE_NOTES[stage])
        if compute != "fp32":
            r.dtype(masters=True)
        if str(ds.get("offload_optimizer_device", "none")).lower() in ("cpu", "nvme"):
            r.set("deepspeed_config.offload_optimizer_device", ds.get("offload_optimizer_device"),
                  "offload_optimizer", True)
        if str(ds.get("offload_param_device", "none")).lower() in ("cpu", "nvme"):
            if stage == 3:     # ds-zero3's offload_param (NVMe modelled as the CPU: the device holds the same)
                r.set("deepspeed_config.offload_param_device", ds.get("offload_param_device"), "offload_param", True)
            else:
                r.ignore("deepspeed_config.offload_param_device", ds.get("offload_param_device"), "DeepSpeed "
                         "offloads parameters at ZeRO stage 3 only (offload_param: valid only with stage 3)")
        if accum is not None:
            r.note_used("deepspeed_config.gradient_accumulation_steps", accum, GA_NOTE)
    if r.zero_stage == 3:           # the job's phases (llmem.setup.job_phases): ZeRO-3's loading and saving
        if "zero3_init_flag" in ds:
            on = r.boolean("deepspeed_config.zero3_init_flag", ds.get("zero3_init_flag"))
            r.set("deepspeed_config.zero3_init_flag", ds.get("zero3_init_flag"), "load_path",
                  "zero-init" if on else "cpu", "" if on else "zero.Init off: every rank loads the whole model")
        if "zero3_save_16bit_model" in ds:
            on = r.boolean("deepspeed_config.zero3_save_16bit_model", ds.get("zero3_save_16bit_model"))
            r.set("deepspeed_config.zero3_save_16bit_model", ds.get("zero3_save_16bit_model"), "save_kind",
                  "gather-16bit" if on else "sharded")
    for key, why, approximates in (("zero3_init_flag", "deepspeed.zero.Init: load time only", False),
                                   ("zero3_save_16bit_model", "checkpoint saving only", False),
                                   ("deepspeed_multinode_launcher", "the launcher: no memory effect", False),
                                   ("seq_parallel_communication_data_type", "sequence parallelism is not modelled",
                                    True)):
        if key in ds and not (r.zero_stage == 3 and key.startswith("zero3_")):
            r.ignore(f"deepspeed_config.{key}", ds.get(key), why, approximates=approximates)


def _parallelism(r: Reading, pc: Keys) -> None:
    """parallelism_config (accelerate's ParallelismConfig): tp -> tensor parallelism; cp / sp are not modelled."""
    def size(name: str) -> int:
        key = f"parallelism_config_{name}_size"
        return r.integer(pc.name(key), pc.get(key, 1), what="a parallel degree") if key in pc else 1

    tp, cp, sp, replicate = size("tp"), size("cp"), size("sp"), size("dp_replicate")
    size("dp_shard")
    if tp > 1:
        r.set("parallelism_config.parallelism_config_tp_size", tp, "tp", tp)
        r.method = "fsdp+tp" if r.method and METHODS[r.method].shards_model_states else "tp"
    for degree, name in ((cp, "cp"), (sp, "sp")):
        if degree > 1:
            r.ignore(f"parallelism_config.parallelism_config_{name}_size", degree, f"{'context' if name == 'cp' else 'sequence'} "
                     "parallelism (each sequence split over GPUs) is not modelled: estimated at the whole sequence "
                     "per GPU; give --seq-len for one GPU's share")
    if replicate > 1:
        r.set("parallelism_config.parallelism_config_dp_replicate_size", replicate, "dp_replicate", replicate,
              "HSDP: FSDP2 shards within each replica")
    for key in ("parallelism_config_sp_backend", "parallelism_config_sp_seq_length_is_variable",
                "parallelism_config_sp_attn_implementation", "parallelism_config_cp_comm_strategy"):
        pc.get(key)
