"""--from FILE: the training configs the frameworks publish (../shared/data/configs, read in place), each read into a
TrainingSetup or refused with a line naming the file and what it cannot express; per framework, `llmem estimate
--from F` equals `llmem estimate` with the flags written out by hand from the file (and the framework's documented
defaults, INDEX.md's "Defaults" section and the framework sources named in llmem/setup/sources); and the bad inputs
a user can give (missing, empty, malformed files)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from published_configs import CONFIGS, SKIP_REASON, present

from llmem.cli import main
from llmem.errors import LlmemError
from llmem.setup.sources import setup_from_file
from llmem.setup.sources.deepspeed import TrainerValues, resolve_auto

pytestmark = pytest.mark.skipif(not present(), reason=SKIP_REASON)
ALL = sorted(p for p in CONFIGS.rglob("*") if p.suffix in (".yaml", ".yml", ".json", ".toml")) \
    if present() else [CONFIGS / "INDEX.md"]       # one id, skipped with SKIP_REASON like the rest


def cfg(rel: str) -> Path:
    return CONFIGS / rel


def run_json(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv + ["--json"]) == 0
    return json.loads(out.getvalue())


def refusal(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def used(fs, field: str):
    """The value the record says `field` got from the file (the last entry that set it)."""
    return [u.value for u in fs.record.used if u.field == field][-1]


# ------------------------------------------------------------------------------------------------ every file


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_published_config_answers_or_names_what_it_cannot_express(path):
    """Alone, each file is a set-up or one refusal naming the file and the missing or unexpressible setting (the
    GPU count a launcher decides, a model an accelerate config does not name, a combination llmem does not
    model); with the GPU count and a model given, the same."""
    for overrides in ({}, {"gpus": 8, "model": "tiny-llama"}):
        try:
            fs = setup_from_file(path, **overrides)
        except LlmemError as exc:
            text = str(exc)
            assert text.startswith(str(path)) and "\n" not in text, text
            assert "give --gpus N" in text or "give MODEL" in text or "cannot run the set-up" in text, text
            continue
        assert fs.record.files[0] == (str(path), fs.record.files[0][1])
        assert fs.record.used, "a file read into a set-up says what it used"


# ------------------------------------------------------------------------------------------------ the mappings


def test_axolotl_lora_8bit_with_modules_to_save():
    """examples/llama-3/lora-8b.yml: load_in_8bit, lora_r 32 / alpha 16 / dropout 0.05, lora_target_linear and
    lora_modules_to_save [embed_tokens, lm_head] (only peft expresses those: an adapter_config.json), mbs 2, seq
    4096, packing, adamw_bnb_8bit, flash_attention_2, bf16 auto (an A100 has bf16) over a bf16 base with peft's
    fp32 adapters: bf16-mixed; axolotl runs prepare_model_for_kbit_training on one GPU: kbit upcast."""
    fs = setup_from_file(cfg("axolotl/examples/llama-3/lora-8b.yml"))
    s = fs.setup
    assert (s.model, s.method, s.gpus, s.batch_size, s.seq_len) == ("NousResearch/Meta-Llama-3-8B", "single", 1, 2,
                                                                      4096)
    assert (s.packing, s.grad_ckpt, s.attn, s.optimizer) == (True, True, "flash", "adamw-8bit")
    assert (s.quant_base, s.kbit_upcast, s.precision, s.adapter_dtype) == ("int8", True, "bf16-mixed", "fp32")
    assert s.lora_rank == 0 and s.peft_config
    peft = json.loads(Path(s.peft_config).read_text())
    assert (peft["peft_type"], peft["r"], peft["lora_alpha"], peft["lora_dropout"]) == ("LORA", 32, 16.0, 0.05)
    assert (peft["target_modules"], peft["modules_to_save"]) == ("all-linear", ["embed_tokens", "lm_head"])


def test_axolotl_full_finetune_is_pure_bf16_and_fsdp_qlora_skips_the_upcast():
    """fft-8b.yaml: axolotl loads the model in bf16 (bf16 auto) and HF Trainer trains those bf16 parameters: pure
    bf16, paged_adamw_8bit, mbs 1 x 8192. qlora-fsdp-70b.yaml: QLoRA under FSDP, where axolotl skips the kbit
    upcast; fsdp_offload_params is FSDP2's CPUOffloadPolicy of the packed NF4 storage (--offload-param)."""
    s = setup_from_file(cfg("axolotl/examples/llama-3/fft-8b.yaml")).setup
    assert (s.precision, s.optimizer, s.batch_size, s.seq_len, s.packing) == ("bf16", "paged-adamw-8bit", 1, 8192,
                                                                               True)
    fs = setup_from_file(cfg("axolotl/examples/llama-3/qlora-fsdp-70b.yaml"), gpus=8)
    s = fs.setup
    assert (s.method, s.quant_base, s.kbit_upcast, s.lora_rank, s.optimizer) == ("fsdp", "nf4", False, 8,
                                                                                  "adamw-fused")
    assert s.precision == "bf16-mixed" and s.double_quant
    assert fs.setup.offload_param and not any(i.key == "fsdp_config.fsdp_offload_params" for i in fs.record.ignored)


def test_fsdp_offload_params_is_fsdp2s_cpu_offload_policy():
    """LLaMA-Factory's fsdp_config_offload.yaml (FULL_SHARD, 2 processes, fsdp_offload_params: true): FSDP2's
    CPUOffloadPolicy, --offload-param; its estimate keeps no parameter, gradient or optimizer state on the device."""
    fs = setup_from_file(cfg("llamafactory/examples/accelerate/fsdp_config_offload.yaml"), model="tiny-llama")
    s = fs.setup
    assert (s.method, s.gpus, s.offload_param) == ("fsdp", 2, True)
    assert any(u.key == "fsdp_config.fsdp_offload_params" and u.field == "offload_param" for u in fs.record.used)
    from llmem.estimator.states import model_states
    from llmem.model.resolved import resolve

    ms = model_states(resolve(s))
    assert (ms.weights, ms.gradients, ms.optimizer_states) == (0, 0, 0)


def test_axolotl_deepspeed_reference_resolves_from_the_framework_folder():
    """lora-1b-ray.yml names deepspeed_configs/zero3.json from axolotl's root: ZeRO-3 -> ds-zero3 with the JSON's
    buffer keys ('auto' kept for llmem to fill from the hidden size, max_live_parameters / max_reuse_distance 0, one
    sub-group per parameter), the 'auto' micro-batch filled from micro_batch_size, 4 Ray workers -> 4 GPUs."""
    fs = setup_from_file(cfg("axolotl/examples/llama-3/lora-1b-ray.yml"), optimizer="adamw")
    assert fs.record.files[1] == (str(CONFIGS / "axolotl/deepspeed_configs/zero3.json"), "deepspeed")
    s = fs.setup
    assert (s.method, s.gpus, s.batch_size, s.precision, s.lora_rank, s.lora_alpha) == ("ds-zero3", 4, 2,
                                                                                         "bf16-mixed", 16, 32)
    assert (s.reduce_bucket_size, s.prefetch_bucket_size, s.param_persistence_threshold) == ("auto",) * 3
    assert (s.overlap_comm, s.sub_group_size, s.max_live_parameters, s.max_reuse_distance) == (True, 0, 0, 0)
    assert any("ZeRO-3 as DeepSpeed's engine runs it" in n for n in fs.record.notes)
    # adamw_8bit (bitsandbytes) on the ZeRO optimizer's flat partition is refused with the file named
    with pytest.raises(LlmemError, match=r"lora-1b-ray.yml: llmem cannot run.*adamw-8bit.*ds-zero3"):
        setup_from_file(cfg("axolotl/examples/llama-3/lora-1b-ray.yml"))


def test_llamafactory_qlora_and_dpo():
    """llama3_lora_sft_bnb_npu.yaml: quantization_bit 4 (bnb), double_quantization false, lora_rank 8, lora_alpha
    unset = 16, lora_target all, cutoff 2048, pdtbs 1, bf16; checkpointing on (disable_gradient_checkpointing
    False), transformers' default optim adamw_torch_fused; LLaMA-Factory never upcasts a kbit base.
    llama3_lora_dpo.yaml: stage dpo, pref_loss sigmoid: TRL's DPO step (LLaMA-Factory's CustomDPOTrainer) of
    pdtbs 1 pair, cutoff_len 2048 its max_length; its own forward's whole fp32 logits make the answer approximate."""
    s = setup_from_file(cfg("llamafactory/examples/train_qlora/llama3_lora_sft_bnb_npu.yaml")).setup
    assert (s.quant_base, s.double_quant, s.kbit_upcast) == ("nf4", False, False)
    assert (s.lora_rank, s.lora_alpha, s.lora_targets, s.lora_dropout) == (8, 16, "all-linear", 0.0)
    assert (s.seq_len, s.batch_size, s.grad_ckpt, s.optimizer, s.precision) == (2048, 1, True, "adamw-fused",
                                                                                  "bf16-mixed")
    dpo = setup_from_file(cfg("llamafactory/examples/train_lora/llama3_lora_dpo.yaml"))
    assert (dpo.setup.objective, dpo.setup.loss_type, dpo.setup.batch_size, dpo.setup.max_length) == \
        ("dpo", "sigmoid", 1, 2048)
    assert not dpo.record.exact and [i.key for i in dpo.record.approximations] == ["stage"]


def test_trl_cli_config_takes_sftconfig_defaults():
    """example_config.yaml sets no memory field: SFTConfig's max_length 1024, gradient_checkpointing True, bf16
    True over ModelConfig's dtype float32 (bf16-mixed), TrainingArguments' batch 8 and adamw_torch_fused."""
    s = setup_from_file(cfg("trl/examples/cli_configs/example_config.yaml")).setup
    assert (s.model, s.seq_len, s.grad_ckpt, s.precision, s.batch_size, s.optimizer) == \
        ("Qwen/Qwen2.5-0.5B", 1024, True, "bf16-mixed", 8, "adamw-fused")


def test_trl_lora_qlora_keys(tmp_path):
    """TRL's ModelConfig: use_peft with lora_r / lora_alpha / lora_dropout / lora_target_modules, load_in_4bit with
    use_bnb_nested_quant False (its default: no double quantisation); dtype bfloat16 keeps the unquantised frozen
    parameters in bf16 (TRL runs no kbit upcast), float32 (the default) holds them in fp32."""
    f = tmp_path / "sft.yaml"
    f.write_text("model_name_or_path: tiny-llama\nuse_peft: true\nlora_r: 8\nlora_alpha: 16\nlora_dropout: 0.0\n"
                 "lora_target_modules: [q_proj, k_proj]\nload_in_4bit: true\ndtype: bfloat16\nmax_length: 512\n"
                 "per_device_train_batch_size: 2\n")
    s = setup_from_file(f).setup
    assert (s.lora_rank, s.lora_alpha, s.lora_targets, s.quant_base, s.double_quant, s.kbit_upcast) == \
        (8, 16, "q_proj,k_proj", "nf4", False, False)
    f.write_text(f.read_text().replace("dtype: bfloat16", "dtype: float32"))
    assert setup_from_file(f).setup.kbit_upcast


def test_torchtune_recipes():
    """8B_qlora_single_device: the qlora_ builder is torchao's NF4 base, LoRA on q/v/output_proj + MLP (HF names),
    rank 8 / alpha 16, dtype bf16 pure with the adapters in bf16, fused AdamW, one device (its tune run line).
    8B_full: the distributed recipe on --nproc_per_node 4 -> fsdp over 4 GPUs. 3B_full_single_device: bitsandbytes
    PagedAdamW8bit stepped in backward."""
    s = setup_from_file(cfg("torchtune/recipes/configs/llama3_1/8B_qlora_single_device.yaml")).setup
    assert (s.model, s.method, s.quant_base, s.precision, s.adapter_dtype) == \
        ("meta-llama/Llama-3.1-8B", "single", "torchao-nf4", "bf16", "base")
    assert (s.lora_rank, s.lora_alpha, s.lora_targets) == (8, 16, "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    assert (s.batch_size, s.optimizer, s.grad_ckpt) == (2, "adamw-fused", True)
    s = setup_from_file(cfg("torchtune/recipes/configs/llama3_1/8B_full.yaml")).setup
    assert (s.method, s.gpus, s.precision, s.optimizer) == ("fsdp", 4, "bf16", "adamw-fused")
    s = setup_from_file(cfg("torchtune/recipes/configs/llama3_2/3B_full_single_device.yaml")).setup
    assert (s.optimizer, s.optimizer_in_backward, s.batch_size) == ("paged-adamw-8bit", True, 4)


def test_torchtitan_both_schemas():
    """llama3_405b.toml: local_batch_size 2, seq_len 8192, TP 8 under FSDP (fsdp+tp), full checkpointing, fused
    AdamW, bf16 MixedPrecisionPolicy over fp32 parameters; the older llama3_8b.toml: batch_size 1 under [training],
    selective op checkpointing (--ac-policy op)."""
    fs = setup_from_file(cfg("torchtitan/torchtitan/models/llama3/train_configs/llama3_405b.toml"), gpus=16)
    s = fs.setup
    assert (s.model, s.method, s.tp, s.batch_size, s.seq_len, s.grad_ckpt, s.optimizer, s.precision) == \
        ("meta-llama/Llama-3.1-405B", "fsdp+tp", 8, 2, 8192, True, "adamw-fused", "bf16-mixed")
    assert any(i.key == "model.converters" for i in fs.record.ignored)
    fs = setup_from_file(cfg("torchtitan/train_configs/llama3_8b.toml"), gpus=8)
    assert (fs.setup.batch_size, fs.setup.grad_ckpt, fs.setup.ac_policy) == (1, True, "op")


def test_accelerate_configs():
    """multi_node.yaml: MULTI_GPU, 8 processes over 2 machines, no mixed precision; single_gpu.yaml of TRL's
    package: distributed_type NO runs one process whatever num_processes says; deepspeed.yaml: its
    deepspeed_config_file (beside the template folder) is ZeRO-1 with fp16 enabled and DeepSpeed's torch AdamW."""
    s = setup_from_file(cfg("accelerate/examples/config_yaml_templates/multi_node.yaml"), model="tiny-llama").setup
    assert (s.method, s.gpus, s.gpus_per_node, s.precision) == ("ddp", 8, 4, "fp32")
    fs = setup_from_file(cfg("trl/trl/accelerate_configs/single_gpu.yaml"), model="tiny-llama")
    assert (fs.setup.method, fs.setup.gpus) == ("single", 1)
    assert any(i.key == "num_processes" for i in fs.record.ignored)
    s = setup_from_file(cfg("accelerate/examples/config_yaml_templates/deepspeed.yaml"), model="tiny-llama").setup
    assert (s.method, s.gpus, s.precision, s.optimizer) == ("ds-zero1", 2, "fp16-mixed", "adamw")


def test_deepspeed_alone():
    """ds_z3_fp8_config.json: ZeRO-3 with offload_optimizer cpu; bf16 'auto' is the trainer's to fill (llmem's
    default stands); zero3_bf16_cpuoffload_params.json: offload_param cpu."""
    fs = setup_from_file(cfg("llamafactory/examples/deepspeed/ds_z3_fp8_config.json"), model="tiny-llama", gpus=2)
    assert (fs.setup.method, fs.setup.offload_optimizer, fs.setup.precision) == ("ds-zero3", True, "bf16-mixed")
    fs = setup_from_file(cfg("axolotl/deepspeed_configs/zero3_bf16_cpuoffload_params.json"), model="tiny-llama",
                         gpus=2)
    assert not fs.setup.offload_optimizer and fs.setup.offload_param
    assert any(u.key == "zero_optimization.offload_param.device" for u in fs.record.used)


def test_auto_is_filled_as_transformers_fills_it():
    """HfTrainerDeepSpeedConfig.trainer_config_process / _finalize (transformers/integrations/deepspeed.py) on
    zero3.json with micro-batch 2, accumulation 4, world 8, bf16 and hidden_size 4096, against llmem's
    resolve_auto: the same filled config."""
    from types import SimpleNamespace

    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    config = json.loads(cfg("axolotl/deepspeed_configs/zero3.json").read_text())
    args = SimpleNamespace(world_size=8, per_device_train_batch_size=2, gradient_accumulation_steps=4,
                           max_grad_norm=1.0, learning_rate=1e-4, adam_beta1=0.9, adam_beta2=0.999,
                           adam_epsilon=1e-8, weight_decay=0.0, save_on_each_node=False, fp16=False,
                           fp16_full_eval=False, bf16=True, bf16_full_eval=False,
                           get_warmup_steps=lambda n: 0)
    hf = HfTrainerDeepSpeedConfig(json.loads(json.dumps(config)))
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=4096)), 100)
    ours, _ = resolve_auto(config, TrainerValues("TrainingArguments", 2, 4, 8, True, False), hidden_size=4096)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        assert ours[key] == hf.config[key]
    assert ours["bf16"] == hf.config["bf16"] and ours["fp16"]["enabled"] == hf.config["fp16"]["enabled"] is False
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        assert ours["zero_optimization"][key] == hf.config["zero_optimization"][key]
    assert ours["zero_optimization"]["reduce_bucket_size"] == 4096 * 4096          # h*h, by hand


def test_flags_override_the_file_even_at_their_default(capsys):
    """--batch-size 1 (llmem's default value) over lora-8b.yml's micro_batch_size 2, and MODEL over base_model."""
    out = run_json(["estimate", "tiny-llama", "--from", str(cfg("axolotl/examples/llama-3/qlora.yml")),
                    "--batch-size", "1", "--seq-len", "128"])
    assert (out["setup"]["model"], out["setup"]["batch_size"], out["setup"]["seq_len"]) == ("tiny-llama", 1, 128)
    assert set(out["from_file"]["overridden_by_command_line"]) == {"model", "batch_size", "seq_len"}
    assert any(u["key"] == "micro_batch_size" and "overridden" in u["note"] for u in out["from_file"]["used"])


# ------------------------------------------------------------------------------------------------ estimate --from F == the flags


def _same(from_args: list[str], flags: str, model: str = "tiny-llama") -> None:
    a = run_json(["estimate", model, "--from"] + from_args + ["--seq-len", "256"])
    b = run_json(["estimate", model, "--seq-len", "256"] + flags.split())
    record = a.pop("from_file")
    assert record["files"] and record["used"]
    assert a == b


def test_estimate_from_axolotl_equals_its_flags():
    _same([str(cfg("axolotl/examples/llama-3/qlora.yml"))],
          "--batch-size 2 --packing --precision bf16-mixed --ckpt-reentrant --attn flash --lora-rank 32 "
          "--lora-alpha 16 --lora-dropout 0.05 --lora-targets all-linear --qlora --optimizer paged-adamw-32bit")


def test_estimate_from_axolotl_modules_to_save_equals_a_hand_written_peft_config(tmp_path):
    """lora-8b.yml's lora_modules_to_save: the same numbers as --peft-config with the adapter_config.json written by
    hand (peft's LoRA r32 / alpha 16 / dropout 0.05 on all-linear, modules_to_save embed_tokens and lm_head)."""
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 32, "lora_alpha": 16, "lora_dropout": 0.05,
         "target_modules": "all-linear", "modules_to_save": ["embed_tokens", "lm_head"]}))
    a = run_json(["estimate", "tiny-llama", "--from", str(cfg("axolotl/examples/llama-3/lora-8b.yml")),
                  "--seq-len", "256"])
    # axolotl's default checkpoint is the reentrant one (normalize_config): LLM.int8 then keeps no layer inputs
    b = run_json(["estimate", "tiny-llama", "--seq-len", "256", "--batch-size", "2", "--packing", "--ckpt-reentrant",
                  "--attn", "flash", "--optimizer", "adamw-8bit", "--load-in-8bit", "--peft-config", str(tmp_path)])
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes", "components"):
        assert a[key] == b[key], key
    assert a["setup"]["trainable_params"] == b["setup"]["trainable_params"]


def test_estimate_from_llamafactory_equals_its_flags():
    _same([str(cfg("llamafactory/examples/train_qlora/llama3_lora_sft_bnb_npu.yaml"))],
          "--trust-remote-code --batch-size 1 --precision bf16-mixed --ckpt-reentrant --optimizer adamw-fused "
          "--lora-rank 8 --lora-alpha 16 --lora-targets all-linear --qlora --no-double-quant --no-kbit-upcast")


def test_estimate_from_llamafactory_with_its_accelerate_config_equals_its_flags():
    """examples/extras/fsdp_qlora: the training YAML launched with examples/accelerate/fsdp_config.yaml (2
    processes, FSDP1 FULL_SHARD, bf16): QLoRA under fsdp on 2 GPUs."""
    _same([str(cfg("llamafactory/examples/extras/fsdp_qlora/llama3_lora_sft.yaml")), "--from",
           str(cfg("llamafactory/examples/accelerate/fsdp_config.yaml"))],
          "--trust-remote-code --method fsdp --gpus 2 --batch-size 1 --precision bf16-mixed --ckpt-reentrant "
          "--optimizer adamw-fused --lora-rank 8 --lora-alpha 16 --lora-targets all-linear --qlora --no-kbit-upcast")


def test_estimate_from_trl_equals_its_flags():
    _same([str(cfg("trl/examples/cli_configs/example_config.yaml"))],
          "--batch-size 8 --precision bf16-mixed --grad-ckpt --optimizer adamw-fused --objective trl-sft",
          model="Qwen/Qwen2.5-0.5B")


def test_estimate_from_torchtune_equals_its_flags():
    _same([str(cfg("torchtune/recipes/configs/llama3_1/8B_lora_single_device.yaml"))],
          "--batch-size 2 --precision bf16 --adapter-dtype base --optimizer adamw-fused --grad-ckpt --lora-rank 8 "
          "--lora-alpha 16 --lora-targets q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")


def test_estimate_from_torchtitan_equals_its_flags():
    _same([str(cfg("torchtitan/train_configs/llama3_70b.toml")), "--gpus", "16"],
          "--method fsdp+tp --tp 8 --gpus 16 --batch-size 8 --precision bf16-mixed --optimizer adamw-fused "
          "--grad-ckpt --sequence-parallel --loss-parallel")


def test_estimate_from_accelerate_equals_its_flags():
    # fsdp_cpu_ram_efficient_loading: true, fsdp_state_dict_type: FULL_STATE_DICT
    _same([str(cfg("trl/examples/accelerate_configs/fsdp2.yaml"))], "--method fsdp --gpus 8 --precision bf16-mixed "
          "--load-path cpu-ram-efficient --save-kind full")


def test_estimate_from_deepspeed_equals_its_flags():
    _same([str(cfg("axolotl/deepspeed_configs/zero3_bf16_cpuoffload_all.json")), "--gpus", "4"],
          "--method ds-zero3 --gpus 4 --precision bf16-mixed --offload-optimizer --offload-param --overlap-comm "
          "--sub-group-size 0 --reduce-bucket-size auto --prefetch-bucket-size auto --param-persistence-threshold auto "
          "--max-live-parameters 0 --max-reuse-distance 0 --save-kind gather-16bit")   # gather_16bit_weights...: true


def test_plan_from_file_restricts_to_the_files_method():
    out = run_json(["plan", "tiny-llama", "--from", str(cfg("trl/examples/accelerate_configs/fsdp2.yaml")),
                    "--seq-len", "128"])
    assert {m["method"] for m in out["methods"]} == {"fsdp"} and out["recommended"]["label"] == "fsdp (8)"
    assert out["from_file"]["files"][0]["format"] == "accelerate"


# ------------------------------------------------------------------------------------------------ bad input


def test_bad_inputs_are_one_line_naming_file_field_and_fix(tmp_path, capsys):
    cases = {
        "unknown.yaml": ("foo: 1\nbar: [2]\n", "not a training config llmem reads (its keys: foo, bar); expected"),
        "zero.yml": ("base_model: tiny-llama\nmicro_batch_size: 0\n", "micro_batch_size = 0 is not a micro-batch"),
        "stage.json": ('{"zero_optimization": {"stage": 4}}', "zero_optimization.stage = 4 is not a ZeRO stage"),
        "both.json": ('{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true}, "bf16": {"enabled": true}}',
                      "cannot be simultaneously enabled"),
        "batch.json": ('{"zero_optimization": {"stage": 1}, "train_batch_size": 10, '
                       '"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1}',
                       "train_batch_size = 10 is not a multiple of micro-batch x accumulation"),
        "titan.toml": ('[job]\ndump_folder = "x"\n[model]\nname = "llama3"\n[training]\nsteps = 10\n',
                       "an unknown torchtitan version"),
        "dropout.yaml": ("base_model: tiny-llama\nadapter: lora\nlora_dropout: 1.5\n",
                         "lora_dropout = 1.5 is not a probability"),
        "fsdp.yaml": ("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 3\n",
                      "fsdp_config.fsdp_version = 3 is not one of 1, 2"),
        "broken.yaml": ("base_model: [unclosed\n", "not valid YAML"),
    }
    for name, (text, expected) in cases.items():
        f = tmp_path / name
        f.write_text(text)
        err = refusal(["estimate", "tiny-llama", "--from", str(f), "--gpus", "4"], capsys)
        assert str(f) in err
        if expected is not None:
            assert expected in err, err
    # a DeepSpeed batch that is not micro x accumulation x world (DeepSpeed's _batch_assertion), world from
    # the accelerate config that launches it
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 1}, "train_batch_size": 10, "train_micro_batch_size_per_gpu": 2,'
                  ' "gradient_accumulation_steps": 1}')
    acc = tmp_path / "acc.yaml"
    acc.write_text(f"distributed_type: DEEPSPEED\nnum_processes: 4\ndeepspeed_config:\n  deepspeed_config_file: "
                   f"{ds}\n")
    err = refusal(["estimate", "tiny-llama", "--from", str(acc)], capsys)
    assert "train_batch_size = 10 is not micro-batch x accumulation x world size (2 x 1 x 4" in err
    # HF Trainer refuses a DeepSpeed micro-batch that differs from per_device_train_batch_size
    lf = tmp_path / "lf.yaml"
    ds.write_text('{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4}')
    lf.write_text(f"model_name_or_path: tiny-llama\nstage: sft\nper_device_train_batch_size: 2\ndeepspeed: {ds}\n")
    err = refusal(["estimate", "--from", str(lf), "--gpus", "2"], capsys)
    assert "train_micro_batch_size_per_gpu = 4 differs from the trainer's per_device_train_batch_size = 2" in err


def test_unknown_model_named_by_a_file(tmp_path, capsys):
    """A model neither the catalog nor the local HF cache knows (offline): llmem's refusal, and how to override it."""
    path = tmp_path / "axolotl.yml"
    path.write_text("base_model: nobody/unknown-7b\nmicro_batch_size: 1\nsequence_len: 512\n")
    err = refusal(["estimate", "--from", str(path)], capsys)
    assert err.startswith("llmem: error: unknown model 'nobody/unknown-7b'") and "give MODEL" in err


def test_missing_model_gpus_and_unknown_model(capsys):
    assert "give a MODEL" in refusal(["estimate"], capsys)
    err = refusal(["estimate", "--from", str(cfg("trl/examples/accelerate_configs/fsdp2.yaml"))], capsys)
    assert "names no model" in err and "give MODEL" in err
    # a DeepSpeed JSON leaves the GPU count to the launcher: answered on one node of 8 (no GPU here), said so
    out = run_json(["estimate", "tiny-llama", "--from", str(cfg("axolotl/deepspeed_configs/zero2.json"))])
    assert out["setup"]["gpus"] == 8 and any("give --gpus N" in n for n in out["from_file"]["notes"])
    # NousResearch/Meta-Llama-3-8B mirrors a catalog model: read offline with its config, the name says so
    out = run_json(["estimate", "--from", str(cfg("axolotl/examples/llama-3/qlora.yml"))])
    assert out["setup"]["model"].startswith("NousResearch/Meta-Llama-3-8B (read as meta-llama/Meta-Llama-3-8B")


@pytest.mark.slow
def test_trace_from_torchtune_equals_its_flags():
    """The real step (trace) of 8B_lora_single_device read --from the file, on tiny-llama at 64 tokens, against
    the same step from the flags written out."""
    a = run_json(["trace", "tiny-llama", "--from", str(cfg("torchtune/recipes/configs/llama3_1/8B_lora_single_device"
                                                          ".yaml")), "--seq-len", "64", "--iterations", "1"])
    b = run_json(["trace", "tiny-llama", "--seq-len", "64", "--iterations", "1", "--batch-size", "2", "--precision",
                  "bf16", "--adapter-dtype", "base", "--optimizer", "adamw-fused", "--grad-ckpt", "--lora-rank", "8",
                  "--lora-alpha", "16", "--lora-targets", "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"])
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "components"):
        assert a[key] == b[key], key
