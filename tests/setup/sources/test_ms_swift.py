"""ms-swift's YAML (llmem.setup.sources.ms_swift) read as ms-swift 4.6.0's argument dataclasses parse it. The
configs under data/ms_swift are its README's commands written as YAML; every expected value is the file's own or
the ms-swift default named beside it (file:line in the 4.6.0 wheel; test_ms_swift_sources checks those defaults
against the sources when they are at hand)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmem.cli import main
from llmem.errors import LlmemError
from llmem.setup.sources import detect_format, setup_from_file
from llmem.setup.sources.ms_swift import DDP_NOTE, REENTRANT_DEFAULT

DATA = Path(__file__).parent / "data" / "ms_swift"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "swift.yaml"
    path.write_text(text)
    return path


def _used(got, key: str):
    return next(u for u in got.record.used if u.key == key)


def test_lora_sft_on_one_gpu():
    got = setup_from_file(DATA / "lora_sft.yaml")
    s = got.setup
    assert (s.model, s.method, s.gpus, s.batch_size, s.seq_len) == ("Qwen/Qwen3-8B", "single", 1, 1, 2048)
    assert (s.lora_rank, s.lora_alpha, s.lora_targets) == (8, 32, "all-linear")
    assert s.lora_dropout == 0.05            # TunerArguments.lora_dropout (tuner_args.py:135)
    assert s.grad_ckpt is True               # TrainArgumentsMixin.gradient_checkpointing True (trainers/arguments.py:135)
    assert s.ckpt_reentrant is True          # _fix_gradient_checkpointing: not distributed -> use_reentrant True
    assert s.precision == "bf16-mixed"       # bf16 autocast, peft's fp32 adapters
    assert s.objective == "sft"
    # get_use_logits_to_keep: on under transformers 5 (Qwen3ForCausalLM.forward takes logits_to_keep)
    assert [i.key for i in got.record.approximations] == ["use_logits_to_keep (ms-swift's default)"]


@pytest.mark.parametrize("extra", ["use_logits_to_keep: false\n", "use_liger_kernel: true\n", "loss_scale: all\n"])
def test_the_whole_logits_are_the_run_without_logits_to_keep(tmp_path, extra):
    """use_logits_to_keep false: every position's logits, as llmem's sft; Liger's fused cross-entropy: none."""
    got = setup_from_file(_write(tmp_path, "model: Qwen/Qwen3-8B\nmax_length: 512\n" + extra))
    assert got.record.exact, got.record.approximations


def test_ddp_runs_the_non_reentrant_checkpoint():
    """trainers/mixin.py _fix_gradient_checkpointing: is_dist() without DeepSpeed or FSDP -> use_reentrant False."""
    got = setup_from_file(DATA / "lora_sft.yaml", gpus=4)
    assert (got.setup.method, got.setup.ckpt_reentrant) == ("ddp", False)
    assert _used(got, REENTRANT_DEFAULT).note == DDP_NOTE


@pytest.mark.parametrize("extra, reentrant, ckpt", [
    ("gradient_checkpointing: false\n", False, False),
    ("gradient_checkpointing_kwargs: '{\"use_reentrant\": false}'\n", False, True),
    ("gradient_checkpointing_kwargs:\n  use_reentrant: true\n", True, True),
])
def test_checkpointing_keys(tmp_path, extra, reentrant, ckpt):
    s = setup_from_file(_write(tmp_path, "model: Qwen/Qwen3-8B\ntuner_type: lora\nmax_length: 512\n" + extra)).setup
    assert (s.grad_ckpt, s.ckpt_reentrant) == (ckpt, reentrant)


def test_full_fine_tuning_under_the_zero2_preset():
    got = setup_from_file(DATA / "full_zero2.yaml")
    s = got.setup
    assert (s.method, s.lora_rank, s.seq_len, s.batch_size) == ("ds-zero2", 0, 4096, 1)
    assert s.gpus == 8                        # the launcher's: one node of 8, said in a note
    assert s.precision == "bf16-mixed"        # DeepSpeed's fp32 master partitions
    assert s.reduce_bucket_size == 200_000_000    # swift/config/zero2.json: "reduce_bucket_size": 2e8
    assert s.overlap_comm is False                # ... "overlap_comm": false
    assert s.ckpt_reentrant is True               # DeepSpeed: use_reentrant True
    assert any(u.key == "train_type" and "full" in u.note for u in got.record.used)


def test_the_zero3_offload_preset(tmp_path):
    """swift/config/zero3_offload.json: stage 3, optimizer and parameters offloaded to the CPU."""
    s = setup_from_file(_write(tmp_path, "model: Qwen/Qwen3-8B\ntuner_type: full\ndeepspeed: zero3_offload\n"
                                         "max_length: 1024\n"), gpus=2).setup
    assert (s.method, s.offload_optimizer, s.offload_param) == ("ds-zero3", True, True)


def test_a_deepspeed_json_file_beside_the_config(tmp_path):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": "auto"}')
    s = setup_from_file(_write(tmp_path, "model: Qwen/Qwen3-8B\ndeepspeed: ds.json\nmax_length: 1024\n"), gpus=2).setup
    assert s.method == "ds-zero1"


def test_the_fsdp2_preset(tmp_path):
    """swift/config/fsdp2.json: full_shard, FSDP2, activation_checkpointing in its fsdp_config."""
    got = setup_from_file(_write(tmp_path, "model: Qwen/Qwen3-8B\ntuner_type: full\nfsdp: fsdp2\nmax_length: 1024\n"),
                          gpus=2)
    assert (got.setup.method, got.setup.grad_ckpt) == ("fsdp", True)
    assert got.setup.ckpt_reentrant is True      # FSDP: _fix_gradient_checkpointing keeps use_reentrant True


def test_dpo_with_lora():
    got = setup_from_file(DATA / "dpo_lora.yaml")
    s = got.setup
    assert (s.objective, s.loss_type, s.batch_size) == ("dpo", "sigmoid", 2)   # rlhf_args.py _set_default: sigmoid
    assert (s.max_length, s.seq_len, s.lora_rank) == (1024, 1024, 8)
    assert "rlhf_type" in {i.key for i in got.record.approximations}      # its own forward keeps the whole logits


def test_grpo_with_colocated_vllm():
    s = setup_from_file(DATA / "grpo_lora_vllm.yaml", gpus=4, batch_size=2).setup
    assert s.objective == "grpo"
    assert (s.num_generations, s.max_completion_length, s.beta) == (8, 512, 0.04)   # rlhf_args.py:164, 242, _init_grpo
    assert (s.use_vllm, s.vllm_mode, s.vllm_gpu_memory_utilization) == (True, "colocate", 0.9)   # args_mixin.py:37
    assert s.seq_len == 1024 + 512            # the prompt's max_length, then the completion
    assert s.loss_type == "grpo"              # rlhf_args.py _set_default
    assert s.gradient_accumulation_steps == 1     # rlhf_args.py _set_default under GRPO


def test_grpo_whose_generation_batch_splits_a_group_is_refused_in_one_line(capsys):
    """1 GPU x batch 1 x steps_per_generation 1 completions: not a whole group of 8 (args_mixin.py refuses it too)."""
    err = _refusal([str(DATA / "grpo_lora_vllm.yaml")], capsys)
    assert "--num-generations 8 must divide the generation batch" in err


def _refusal(paths: list[str], capsys) -> str:
    argv = ["estimate", "--from", *paths]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_vision_language_model_trained_whole():
    got = setup_from_file(DATA / "vlm_full.yaml", images_per_sample=1, image_size="1024x768")
    s = got.setup
    assert (s.freeze_vision_tower, s.freeze_projector, s.freeze_language_model) == (False, False, False)
    assert (s.max_pixels, s.attn, s.precision) == (1003520, "flash", "bf16")   # bf16 weights trained as they are


def test_freeze_defaults_freeze_the_tower_and_the_aligner(tmp_path):
    """TunerArguments: freeze_vit True, freeze_aligner True, freeze_llm False (tuner_args.py:122-124)."""
    path = _write(tmp_path, "model: Qwen/Qwen2.5-VL-3B-Instruct\ntuner_type: full\nmax_length: 1024\n")
    s = setup_from_file(path, images_per_sample=1, image_size="448x448").setup
    assert (s.freeze_vision_tower, s.freeze_projector, s.freeze_language_model) == (True, True, False)


def test_without_images_the_written_switches_are_ignored():
    got = setup_from_file(DATA / "vlm_full.yaml")
    assert {"freeze_vit", "freeze_aligner", "max_pixels"} <= {i.key for i in got.record.ignored}


def test_lora_on_the_vision_tower_is_refused(tmp_path):
    path = _write(tmp_path, "model: Qwen/Qwen2.5-VL-3B-Instruct\ntuner_type: lora\nfreeze_vit: false\n")
    with pytest.raises(LlmemError, match="freeze_vit = False changes which parts all-linear puts LoRA on"):
        setup_from_file(path)


def test_qlora(tmp_path):
    """quant_args.py: bnb 4-bit, nf4 and double quantisation by default; no prepare_model_for_kbit_training."""
    path = _write(tmp_path, "model: Qwen/Qwen3-8B\ntuner_type: lora\nquant_method: bnb\nquant_bits: 4\n"
                            "torch_dtype: bfloat16\nmax_length: 1024\n")
    s = setup_from_file(path).setup
    assert (s.quant_base, s.double_quant, s.kbit_upcast) == ("nf4", True, False)


@pytest.mark.parametrize("dtype, tuner, precision", [
    ("float16", "full", "fp16"),              # fp16 autocast over fp16 weights, trained as they are
    ("float32", "full", "fp16-mixed"),        # _init_mixed_precision: fp16 over float32 weights
    ("bfloat16", "lora", "bf16-mixed"),
])
def test_torch_dtype_decides_the_autocast(tmp_path, dtype, tuner, precision):
    path = _write(tmp_path, f"model: Qwen/Qwen3-8B\ntuner_type: {tuner}\ntorch_dtype: {dtype}\nmax_length: 512\n")
    assert setup_from_file(path).setup.precision == precision


def test_packing_and_the_length_the_data_decides(tmp_path):
    path = _write(tmp_path, "model: Qwen/Qwen3-8B\npacking: true\nattn_impl: flash_attn\n")
    got = setup_from_file(path)
    assert (got.setup.packing, got.setup.attn) == (True, "flash")
    assert "max_length (default)" in {i.key for i in got.record.approximations}
    settled = setup_from_file(path, seq_len=4096).record.approximations     # --seq-len settles it
    assert "max_length (default)" not in {i.key for i in settled}


def test_a_ray_launch_names_its_gpus(tmp_path):
    """swift sft under use_ray runs its trainer on device_groups.default (pipelines/train/sft.py)."""
    path = _write(tmp_path, "model: Qwen/Qwen3-8B\nmax_length: 512\nuse_ray: true\ndevice_groups:\n"
                            "  nproc_per_node: 4\n  default:\n    device: GPU\n    ranks: list(range(0, 4))\n"
                            "    workers:\n      - default\n")
    s = setup_from_file(path).setup
    assert (s.gpus, s.method, s.ckpt_reentrant) == (4, "ddp", False)


@pytest.mark.parametrize("extra, key", [
    ("tuner_type: adalora\n", "tuner_type"),
    ("rlhf_type: ppo\n", "rlhf_type"),
    ("task_type: seq_cls\n", "task_type"),
    ("quant_method: hqq\nquant_bits: 4\n", "quant_method"),
    ("sequence_parallel_size: 2\n", "sequence_parallel_size"),
    ("tuner_backend: unsloth\n", "tuner_backend"),
    ("micro_batch_size: 2\ntensor_model_parallel_size: 1\n", "micro_batch_size"),
    ("quant_bits: 4\n", "quant_bits"),
    ("packing: true\n", "packing"),
    ("target_modules: [all-linear, all-embedding]\n", "target_modules"),                                   # sft_args.py: needs flash attention
    ("rlhf_type: orpo\npadding_free: true\nattn_impl: flash_attn\n", "padding_free"),
])
def test_what_llmem_cannot_model_is_refused_naming_the_key(tmp_path, capsys, extra, key):
    path = _write(tmp_path, "model: Qwen/Qwen3-8B\nmax_length: 512\n" + extra)
    err = _refusal([str(path)], capsys)
    assert f"{key} = " in err


@pytest.mark.parametrize("text, fmt", [
    ("model: Qwen/Qwen3-8B\nlora_rank: 16\n", "ms-swift"),                  # tuner_type's default: lora
    ("model: Qwen/Qwen3-8B\ntrain_type: full\n", "ms-swift"),
    ("model_name_or_path: Qwen/Qwen3-8B\nmax_length: 512\n", "trl"),
    ("model_name_or_path: Qwen/Qwen3-8B\nstage: sft\n", "llamafactory"),
])
def test_detection(text, fmt):
    assert detect_format(Path("x.yaml"), yaml.safe_load(text)) == fmt


@pytest.mark.parametrize("rlhf, extra, objective, batch", [
    ("kto", "", "kto", 2),
    ("orpo", "", "orpo", 2),
    ("simpo", "", "simpo", 2),
    ("cpo", "loss_type: simpo\n", "simpo", 2),          # rlhf_args.py _init_simpo: simpo is CPO's simpo loss
])
def test_the_preference_trainers(tmp_path, rlhf, extra, objective, batch):
    path = _write(tmp_path, f"rlhf_type: {rlhf}\nmodel: Qwen/Qwen3-8B\nmax_length: 1024\n"
                            f"per_device_train_batch_size: {batch}\n" + extra)
    s = setup_from_file(path).setup
    assert (s.objective, s.batch_size, s.max_length) == (objective, batch, 1024)


def test_cpo_with_its_own_loss_is_refused(tmp_path):
    path = _write(tmp_path, "rlhf_type: cpo\nmodel: Qwen/Qwen3-8B\nmax_length: 1024\n")
    with pytest.raises(LlmemError, match="rlhf_type = 'cpo' is not a trainer llmem models"):
        setup_from_file(path)


@pytest.mark.parametrize("dtype, flags, precision", [
    ("bfloat16", "bf16: false\nfp16: false\n", "bf16"),     # no autocast: the bf16 weights train as they are
    ("float32", "fp16: false\n", "fp32"),
])
def test_explicit_mixed_precision_switches(tmp_path, dtype, flags, precision):
    path = _write(tmp_path, f"model: Qwen/Qwen3-8B\ntuner_type: full\ntorch_dtype: {dtype}\nmax_length: 512\n" + flags)
    assert setup_from_file(path).setup.precision == precision


def test_lora_on_a_vision_language_model_with_images(tmp_path):
    """ms-swift's defaults put LoRA on the language model's linears only (get_multimodal_target_regex), which is
    llmem's all-linear on a VLM: the parts' switches say nothing more under LoRA."""
    path = _write(tmp_path, "model: Qwen/Qwen2.5-VL-3B-Instruct\nfreeze_vit: true\nmax_length: 1024\n")
    got = setup_from_file(path, images_per_sample=2, image_size="448x448")
    assert (got.setup.lora_rank, got.setup.lora_targets, got.setup.images_per_sample) == (8, "all-linear", 2)
    assert _used(got, "freeze_vit").note == "LoRA: the base is frozen whatever it says"
