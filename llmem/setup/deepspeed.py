"""DeepSpeed on the set-up floor: ZeRO's knobs as its config resolves them, one frozen `ZeroConfig` per ds-zero set-up.

The defaults are DeepSpeed's own (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig, the installed 0.19.x):
reduce_bucket_size 5e8 elements, overlap_comm on for stage 3 only (its `overlap_comm_valid` validator),
contiguous_gradients on, stage3_prefetch_bucket_size 5e7, stage3_param_persistence_threshold 1e5,
stage3_max_live_parameters 1e9, stage3_max_reuse_distance 1e9, sub_group_size 1e9. HF's Trainer fills the "auto"
ones from the model's hidden size (llmem.setup.sources.deepspeed); a value the set-up gives overrides the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from llmem.errors import LlmemError

# DeepSpeedZeroConfig's field defaults (deepspeed/runtime/zero/config.py)
REDUCE_BUCKET_SIZE = 500_000_000           # reduce_bucket_size: int = Field(pp_int(5e8), gt=0)
PREFETCH_BUCKET_SIZE = 50_000_000          # prefetch_bucket_size: Field(pp_int(5e7), alias="stage3_prefetch_...")
PARAM_PERSISTENCE_THRESHOLD = 100_000      # param_persistence_threshold: Field(pp_int(1e5), ...)
MAX_LIVE_PARAMETERS = 1_000_000_000        # max_live_parameters: Field(pp_int(1e9), ...)
MAX_REUSE_DISTANCE = 1_000_000_000         # max_reuse_distance: Field(pp_int(1e9), ...)
SUB_GROUP_SIZE = 1_000_000_000             # sub_group_size: int = Field(pp_int(1e9), ge=0)
# DeepSpeedZeroOptimizer.nccl_start_alignment_factor (stage_1_and_2.py): "4-byte alignment/sizeof(fp16) = 2"; the
# flat buffer of a parameter group is padded to a multiple of 2 x dp elements
NCCL_START_ALIGNMENT_FACTOR = 2

AUTO = "auto"
# HF's "auto" for the hidden-size keys (transformers' HfTrainerDeepSpeedConfig.trainer_config_finalize; accelerate
# the same with int(0.9 h^2)): field -> (the rule as written, hidden_size -> elements)
HIDDEN_SIZE_RULES = {
    "reduce_bucket_size": ("hidden_size*hidden_size", lambda h: h * h),
    "prefetch_bucket_size": ("int(0.9*hidden_size*hidden_size)", lambda h: int(0.9 * h * h)),
    "param_persistence_threshold": ("10*hidden_size", lambda h: 10 * h),
}

# the TrainingSetup fields a DeepSpeed config sets, and the stage they need (None: any ds-zero stage)
ZERO_FIELDS: dict[str, int | None] = {
    "reduce_bucket_size": None, "overlap_comm": None, "prefetch_bucket_size": 3, "param_persistence_threshold": 3,
    "max_live_parameters": 3, "max_reuse_distance": 3, "sub_group_size": None, "offload_param": 3,
}


@dataclass(frozen=True)
class ZeroConfig:
    """One ds-zero run's ZeRO section, resolved (sizes in elements, as DeepSpeed's config gives them)."""
    stage: int
    reduce_bucket_size: int
    overlap_comm: bool
    prefetch_bucket_size: int
    param_persistence_threshold: int
    max_live_parameters: int
    max_reuse_distance: int
    sub_group_size: int
    offload_optimizer: bool
    offload_param: bool
    contiguous_gradients: bool = True

    def to_json(self) -> dict:
        """The `zero_optimization` block of a DeepSpeed JSON with these values (what --export deepspeed writes)."""
        block: dict = {"stage": self.stage, "overlap_comm": self.overlap_comm,
                       "contiguous_gradients": self.contiguous_gradients,
                       "reduce_bucket_size": self.reduce_bucket_size, "sub_group_size": self.sub_group_size}
        if self.stage == 3:
            block.update({"stage3_prefetch_bucket_size": self.prefetch_bucket_size,
                          "stage3_param_persistence_threshold": self.param_persistence_threshold,
                          "stage3_max_live_parameters": self.max_live_parameters,
                          "stage3_max_reuse_distance": self.max_reuse_distance})
        if self.offload_optimizer:
            block["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if self.offload_param:
            block["offload_param"] = {"device": "cpu", "pin_memory": True}
        return block


def zero_config(setup, stage: int, hidden_size: int) -> ZeroConfig:
    """`setup`'s (a TrainingSetup) ZeRO section at `stage` for a model of `hidden_size`: its values where given
    ("auto" as HF fills it), DeepSpeed's defaults where not."""
    def given(name: str, default: int) -> int:
        value = getattr(setup, name)
        if value == AUTO:
            return HIDDEN_SIZE_RULES[name][1](hidden_size)
        return default if value is None else value

    return ZeroConfig(
        stage=stage,
        reduce_bucket_size=given("reduce_bucket_size", REDUCE_BUCKET_SIZE),
        overlap_comm=stage == 3 if setup.overlap_comm is None else setup.overlap_comm,
        prefetch_bucket_size=given("prefetch_bucket_size", PREFETCH_BUCKET_SIZE),
        param_persistence_threshold=given("param_persistence_threshold", PARAM_PERSISTENCE_THRESHOLD),
        max_live_parameters=given("max_live_parameters", MAX_LIVE_PARAMETERS),
        max_reuse_distance=given("max_reuse_distance", MAX_REUSE_DISTANCE),
        sub_group_size=given("sub_group_size", SUB_GROUP_SIZE),
        offload_optimizer=setup.offload_optimizer,
        offload_param=setup.offload_param,
    )


def flat_partition_numel(numel: int, dp: int) -> int:
    """This rank's share of a stage-1/2 flat buffer of `numel` elements: the buffer padded to a multiple of
    nccl_start_alignment_factor x dp (stage_1_and_2.py: aligned_numel), split in dp equal partitions."""
    align = NCCL_START_ALIGNMENT_FACTOR * dp
    return ceil(numel / align) * align // dp


def param_partition_numel(numel: int, dp: int) -> int:
    """A stage-3 parameter's partition (partition_parameters.py _partition_param: ds_tensor of
    ceil(ds_numel / world_size) elements)."""
    return ceil(numel / dp)


def bucket_buffers(zero: ZeroConfig) -> int:
    """IPG buffers one backward holds: setup_buckets makes one of reduce_bucket_size elements, a second under
    overlap_comm (stages 1-2: "double buffers to avoid data access conflict"); stage 3 one flat bucket."""
    return 2 if zero.stage < 3 and zero.overlap_comm else 1


def partition_numel(numels: list[int], stage: int, dp: int) -> int:
    """Elements of this rank's partition of the trained parameters (`numels`)."""
    if stage == 3:
        return sum(param_partition_numel(n, dp) for n in numels)
    return flat_partition_numel(sum(numels), dp)


def sub_group_numels(partitions: list[int], sub_group_size: int) -> list[int]:
    """Stage 3's optimizer sub-groups over this rank's parameter partitions, in order (stage3.py
    _create_fp16_sub_groups): consecutive parameters until a group reaches sub_group_size elements (0: one group per
    parameter), one group when the whole partition is smaller."""
    total = sum(partitions)
    if sub_group_size >= total:
        return [total] if total else []
    groups, filled = [], 0
    for n in partitions:
        filled += n
        if filled >= sub_group_size:
            groups.append(filled)
            filled = 0
    return groups + ([filled] if filled else [])


def partition_gradient_numels(numels: list[int], stage: int, dp: int) -> list[int]:
    """Element counts of the gradients rank 0 holds for its step, in order: stages 1-2 every trained parameter that
    overlaps its share of the flat buffer, whole (params_in_partition, as grads_in_partition holds them); stage 3 its
    partition of each."""
    if stage == 3:
        return [param_partition_numel(n, dp) for n in numels]
    share, out, start = flat_partition_numel(sum(numels), dp), [], 0
    for n in numels:
        if start < share:
            out.append(n)
        start += n
    return out


def partition_norm_numels(numels: list[int], stage: int, dp: int) -> list[int]:
    """Element counts of the gradients rank 0's norm reads, in order: stages 1-2 the part of each trained parameter
    inside its share of the flat buffer (averaged_gradients: get_flat_partition's views, from first_offset, the last
    one cut at partition_size; a vision-language model's embedding, after its tower, straddles the share's end);
    stage 3 its partition of each."""
    if stage == 3:
        return [param_partition_numel(n, dp) for n in numels]
    share, out, start = flat_partition_numel(sum(numels), dp), [], 0
    for n in numels:
        if start < share:
            out.append(min(n, share - start))
        start += n
    return out


# What TRL's trainers under DeepSpeed's engine do not model yet: (applies to the set-up, flag, why)
_NOT_TRL_UNDER_DEEPSPEED = (
    (lambda s, generates: generates and s.use_vllm, "--use-vllm",
     "TRL's weight sync to vLLM from a DeepSpeed engine (GatheredParameters per parameter) is not modelled yet"),
    (lambda s, generates: s.precompute_ref_log_probs and s.method == "ds-zero3", "--precompute-ref-log-probs",
     "TRL's precompute engine (prepare_deepspeed(self.model)) hooks the policy's ZeRO-3 parameters a second time, "
     "which is not modelled yet"),
    (lambda s, generates: s.offload_param, "--offload-param",
     "TRL's trainers with ZeRO-3's parameter offload (also the reference's engine: prepare_deepspeed keeps "
     "offload_param) are not modelled yet"),
)


def check_trl_deepspeed(setup, generates: bool) -> None:
    """A TRL objective under a ds-zero method (`generates`: GRPO / RLOO): what is not modelled yet, one line."""
    for applies, flag, why in _NOT_TRL_UNDER_DEEPSPEED:
        if applies(setup, generates):
            raise LlmemError(f"--objective {setup.objective} with {flag} under DeepSpeed (--method {setup.method}): "
                             f"{why}; use --method fsdp or zero2 (FSDP2), ddp or single")


def reference_engine_note(stage: int, copy: bool) -> str:
    """How TRL holds the reference under DeepSpeed (trl/models/utils.py prepare_deepspeed; `copy`: the step keeps a
    separate reference model, not peft's adapters-off policy nor precomputed log-probs)."""
    if not copy:
        return "reference under DeepSpeed: no separate model, so no prepare_deepspeed engine"
    if stage == 3:
        return ("reference under DeepSpeed: TRL's prepare_deepspeed engine at ZeRO stage 3 without optimizer "
                "(DeepSpeedZeRoOffload): each parameter partitioned over the ranks (ceil(numel / dp) elements each), "
                "gathered per module in its forward, in the engine's dtype (bf16 / fp16 under *-mixed, whatever "
                "--ref-dtype)")
    return (f"reference under DeepSpeed: TRL's prepare_deepspeed engine with ZeRO off for it (stage {stage} -> 0): "
            "the whole copy on every rank, cast to the engine's dtype (bf16 / fp16 under *-mixed, whatever "
            "--ref-dtype)")
