"""Which TRL trainer a `trl <command> --config FILE` mapping is for. The file is one flat mapping of TrlParser's
dataclasses (trl/scripts/<command>.py make_parser: ScriptArguments, the command's config, ModelConfig,
DatasetMixtureConfig); the command, not the file, names the trainer, and TrlParser leaves a key no dataclass has
unused (set_defaults_with_config, trl/scripts/utils.py). So the trainer is told from the keys: the configs that
have every trainer key the file sets (the fields beyond TrainingArguments', TRL_CONFIGS, the installed trl 1.16's:
tests/setup/sources/test_from_file.py checks them against its dataclasses), narrowed by loss_type's value; several left is
ambiguous (the first in TRL_CONFIGS' order is taken, said so, and `--objective` decides)."""

from __future__ import annotations

from dataclasses import dataclass

from llmem.setup.generation import GRPO_LOSS_TYPES
from llmem.setup.objectives import DPO_LOSS_TYPES, KTO_LOSS_TYPES, NOT_YET, OBJECTIVES, SFT_LOSS_TYPES

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo", "alphapo")  # CPOConfig.loss_type's choices


@dataclass(frozen=True)
class TrlConfig:
    name: str                        # TRL's config class
    objective: str                   # llmem's --objective for its trainer
    fields: tuple[str, ...]          # its fields beyond TrainingArguments'
    loss_types: tuple[str, ...] = ()   # the loss_type values it accepts (none: it has no loss_type)


TRL_CONFIGS: tuple[TrlConfig, ...] = (
    # SFTTrainer: sft's step with the loss through TRL's fused LM head (--objective trl-sft)
    TrlConfig("SFTConfig", "trl-sft", (
              "activation_offloading", "assistant_only_loss", "chat_template_path", "completion_only_loss",
              "dataset_kwargs", "dataset_num_proc", "dataset_text_field", "eos_token", "eval_packing",
              "loss_type", "max_length", "model_init_kwargs", "packing", "packing_strategy",
              "pad_to_multiple_of", "pad_token", "padding_free", "router_aux_loss_coef", "shuffle_dataset",
              "truncation_mode", "trust_remote_code"), SFT_LOSS_TYPES),
    TrlConfig("DPOConfig", "dpo", (
              "activation_offloading", "beta", "dataset_num_proc", "disable_dropout", "discopop_tau",
              "f_alpha_divergence_coef", "f_divergence_type", "label_smoothing", "ld_alpha", "loss_type",
              "loss_weights", "max_length", "model_init_kwargs", "pad_to_multiple_of", "pad_token",
              "padding_free", "precompute_ref_batch_size", "precompute_ref_log_probs", "ref_model_mixup_alpha",
              "ref_model_sync_steps", "router_aux_loss_coef", "sync_ref_model", "truncation_mode",
              "trust_remote_code", "use_weighting"), DPO_LOSS_TYPES),
    TrlConfig("KTOConfig", "kto", (
              "activation_offloading", "beta", "dataset_num_proc", "desirable_weight", "disable_dropout",
              "loss_type", "max_length", "model_init_kwargs", "pad_to_multiple_of", "precompute_ref_batch_size",
              "precompute_ref_log_probs", "ref_model_mixup_alpha", "ref_model_sync_steps",
              "router_aux_loss_coef", "sync_ref_model", "trust_remote_code", "undesirable_weight"), KTO_LOSS_TYPES),
    TrlConfig("RewardConfig", "reward", (
              "activation_offloading", "center_rewards_coefficient", "chat_template_path", "dataset_num_proc",
              "disable_dropout", "eos_token", "max_length", "model_init_kwargs", "pad_to_multiple_of",
              "pad_token", "trust_remote_code")),
    TrlConfig("GRPOConfig", "grpo", (
              "beta", "cache_implementation", "cast_lm_head_to_fp32", "chat_template_kwargs", "delta",
              "disable_dropout", "ds3_gather_for_generation", "entropy_coef", "entropy_coef_delta",
              "entropy_coef_max", "entropy_coef_min", "entropy_target", "epsilon", "epsilon_high",
              "generation_batch_size", "generation_kwargs", "importance_sampling_level", "log_completions",
              "log_completions_hub_repo", "log_multimodal", "log_unique_prompts", "loss_type",
              "mask_truncated_completions", "max_completion_length", "max_tool_calling_iterations", "min_p",
              "model_init_kwargs", "multi_objective_aggregation", "num_completions_to_print", "num_generations",
              "num_generations_eval", "num_iterations", "off_policy_mask_threshold", "pad_to_multiple_of",
              "ref_model_mixup_alpha", "ref_model_sync_steps", "repetition_penalty", "reward_weights",
              "router_aux_loss_coef", "sapo_temperature_neg", "sapo_temperature_pos", "scale_rewards",
              "shuffle_dataset", "steps_per_generation", "sync_ref_model", "temperature",
              "top_entropy_quantile", "top_k", "top_p", "transformers_continuous_batching_config",
              "trust_remote_code", "use_adaptive_entropy", "use_bias_correction_kl",
              "use_transformers_continuous_batching", "use_transformers_paged", "use_vllm", "vespo_k_neg",
              "vespo_k_pos", "vespo_lambda_neg", "vespo_lambda_pos", "vllm_enable_sleep_mode",
              "vllm_gpu_memory_utilization", "vllm_group_port", "vllm_importance_sampling_cap",
              "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
              "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_max_model_length",
              "vllm_mode", "vllm_model_impl", "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
              "vllm_server_timeout", "vllm_structured_outputs_regex", "vllm_tensor_parallel_size"),
              GRPO_LOSS_TYPES + ("vespo",)),
    TrlConfig("RLOOConfig", "rloo", (
              "beta", "cache_implementation", "chat_template_kwargs", "disable_dropout",
              "ds3_gather_for_generation", "epsilon", "epsilon_high", "generation_batch_size",
              "generation_kwargs", "log_completions", "log_multimodal", "log_unique_prompts",
              "mask_truncated_completions", "max_completion_length", "min_p", "model_init_kwargs",
              "normalize_advantages", "num_completions_to_print", "num_generations", "num_generations_eval",
              "num_iterations", "pad_to_multiple_of", "ref_model_mixup_alpha", "ref_model_sync_steps",
              "repetition_penalty", "reward_clip_range", "reward_weights", "router_aux_loss_coef",
              "shuffle_dataset", "steps_per_generation", "sync_ref_model", "temperature", "top_k", "top_p",
              "transformers_continuous_batching_config", "trust_remote_code",
              "use_transformers_continuous_batching", "use_transformers_paged", "use_vllm",
              "vllm_enable_sleep_mode", "vllm_gpu_memory_utilization", "vllm_group_port",
              "vllm_max_model_length", "vllm_mode", "vllm_model_impl", "vllm_server_base_url",
              "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_structured_outputs_regex",
              "vllm_tensor_parallel_size")),
    TrlConfig("ORPOConfig", "orpo", (
              "beta", "dataset_num_proc", "disable_dropout", "generate_during_eval", "is_encoder_decoder",
              "max_completion_length", "max_length", "model_init_kwargs", "padding_value", "trust_remote_code")),
    TrlConfig("CPOConfig", "simpo", (
              "alpha", "beta", "cpo_alpha", "dataset_num_proc", "disable_dropout", "generate_during_eval",
              "is_encoder_decoder", "label_smoothing", "loss_type", "max_completion_length", "max_length",
              "model_init_kwargs", "simpo_gamma", "trust_remote_code"), CPO_LOSS_TYPES),
    # trl distillation: a teacher model's forward in every step, not modelled (refused, never read as GRPO's)
    TrlConfig("DistillationConfig", "distillation", (
              "beta", "cache_implementation", "chat_template_kwargs", "disable_dropout", "ds3_gather_for_generation",
              "generation_kwargs", "log_completions", "log_unique_prompts", "max_completion_length",
              "max_tool_calling_iterations", "min_p", "model_init_kwargs", "num_completions_to_print",
              "pad_to_multiple_of", "repetition_penalty", "shuffle_dataset", "teacher_model_init_kwargs",
              "teacher_model_name_or_path", "teacher_model_revision", "temperature", "top_k", "top_p",
              "trust_remote_code", "use_vllm", "vllm_enable_sleep_mode", "vllm_gpu_memory_utilization",
              "vllm_group_port", "vllm_max_model_length", "vllm_mode", "vllm_model_impl", "vllm_server_base_url",
              "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_structured_outputs_regex",
              "vllm_tensor_parallel_size")),
)

TRAINER_KEYS = frozenset(k for c in TRL_CONFIGS for k in c.fields)
SHARED_KEYS = frozenset(k for k in TRAINER_KEYS if all(k in c.fields for c in TRL_CONFIGS))


@dataclass(frozen=True)
class Fit:
    """The configs a file's keys fit, in TRL_CONFIGS' order (the first is taken), and the keys that told."""
    configs: tuple[TrlConfig, ...]
    evidence: tuple[str, ...]        # the file's trainer keys not every config has
    loss_type: tuple[str, ...]       # loss_type's value(s) as written (DPOConfig's is a list)

    @property
    def config(self) -> TrlConfig:
        return self.configs[0]

    @property
    def ambiguous(self) -> bool:
        return len(self.configs) > 1

    def strays(self, data: dict) -> list[str]:
        """The file's trainer keys the taken config has not (TrlParser leaves them unused)."""
        return [k for k in data if k in TRAINER_KEYS and k not in self.config.fields]


def fit(data: dict) -> Fit | None:
    """The configs the mapping's trainer keys fit (those with every key, else those with the most), narrowed by
    loss_type's value; None when loss_type fits none of them. No trainer key: every config, SFTConfig first."""
    keys = [k for k in data if k in TRAINER_KEYS]
    counts = {c.name: sum(k in c.fields for k in keys) for c in TRL_CONFIGS}
    most = max(counts.values())
    configs = [c for c in TRL_CONFIGS if counts[c.name] == most]
    raw = data.get("loss_type")
    losses = tuple(str(v) for v in (raw if isinstance(raw, list) else [] if raw is None else [raw]))
    if losses:
        configs = [c for c in configs if all(v in c.loss_types for v in losses)]
        if not configs:
            return None
    return Fit(tuple(configs), tuple(k for k in keys if k not in SHARED_KEYS), losses)


def not_modelled(config: TrlConfig) -> bool:
    """The trainer is one llmem does not model (yet): its config's keys are refused, not read as another's."""
    return config.objective in NOT_YET or config.objective not in OBJECTIVES
