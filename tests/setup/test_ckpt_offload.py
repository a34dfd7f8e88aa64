"""--ckpt-offload: Unsloth's offloaded checkpoints (unsloth_zoo 2026.10.9's UnslothCheckpointFunction and its first
Unsloth_Offloaded_Gradient_Checkpointer, as LLaMA-Factory and axolotl copy it). The per-layer device bytes worked by
hand, the estimate's and the trace's peaks against torch's reentrant checkpoint, the copied Function's gradients
against an unchecked layer, the --from readings, and the refusals."""

from __future__ import annotations

import pytest
import torch
import yaml

from llmem import estimate
from llmem.cli import main
from llmem.errors import LlmemError
from llmem.memory.activations.ckpt_offload import offloaded_checkpoint
from llmem.setup.sources import setup_from_file
from llmem.setup.training import user_setup

MIB = 2 ** 20
# Llama-3.2-1B: hidden 2048, 16 decoder layers; a micro-batch of 2 x 512 tokens
LLAMA_1B = dict(model="meta-llama/Llama-3.2-1B", precision="bf16", batch_size=2, seq_len=512, lora_rank=8)
HIDDEN_BF16 = 2 * 512 * 2048 * 2          # a layer input, [2, 512, 2048] in bf16: 4 MiB


def test_the_flag_implies_the_reentrant_checkpoint():
    s = user_setup(model="tiny-llama", ckpt_offload="unsloth")
    assert s.grad_ckpt and s.ckpt_reentrant and s.to_dict()["ckpt_offload"] == "unsloth"
    assert "ckpt_offload" not in user_setup(model="tiny-llama").to_dict()


def test_per_layer_bytes_by_hand():
    # bf16 input of 4 MiB: over MINIMUM_SIZE (2 MiB); stored as it is; every layer offloads in the first step, the
    # last (index 15) keeps its input from the second on; the staging buffers are 4 MiB each, the reload a view
    oc = offloaded_checkpoint("unsloth", HIDDEN_BF16, 2)
    assert oc.stored_bytes == 4 * MIB and oc.staging_bytes == 4 * MIB and oc.cast_bytes == 0
    assert all(oc.offloads(i, 15, 0) for i in range(16))
    assert [i for i in range(16) if not oc.offloads(i, 15, 1)] == [15]
    assert oc.reload_bytes(first_tensor_is_input=False) == 0
    # 16 host slots of 4 MiB, and the 200 - 16 initial 256 KiB slots Unsloth pins at start
    assert oc.host_bytes(16) == 16 * 4 * MIB + (200 - 16) * 256 * 1024
    # an fp32 input of 8 MiB: stored as bf16 (4 MiB), converted on the device first (a 4 MiB temporary), cast back
    # for the recompute (8 MiB), unless the recompute's first kept tensor is that input
    oc = offloaded_checkpoint("unsloth", 2 * HIDDEN_BF16, 4)
    assert (oc.stored_bytes, oc.cast_bytes, oc.staging_bytes) == (4 * MIB, 4 * MIB, 4 * MIB)
    assert oc.reload_bytes(False) == 8 * MIB and oc.reload_bytes(True) == 0
    # exactly 2 MiB is not over MINIMUM_SIZE: nothing offloaded, no staging buffer made
    oc = offloaded_checkpoint("unsloth", 2 * MIB, 2)
    assert not any(oc.offloads(i, 15, it) for i in range(16) for it in (0, 1))
    # the classic Function: every layer, every step, back as a new device tensor of the input's bytes
    oc = offloaded_checkpoint("unsloth-classic", 2 * MIB, 2)
    assert all(oc.offloads(i, 15, 1) for i in range(16)) and oc.staging_bytes == 0
    assert oc.reload_bytes(False) == 2 * MIB and offloaded_checkpoint("none", 2 * MIB, 2) is None


@pytest.mark.parametrize("name, kept", [
    ("unsloth", 3),             # the last layer's input and two staging buffers
    ("unsloth-single", 2),      # the last layer's input and one staging buffer
    ("unsloth-classic", 0),     # nothing: every input on the host, none reloaded yet at the loss
])
def test_the_estimate_keeps_what_the_function_keeps(name, kept):
    # at the step's peak (the loss's backward), torch's reentrant checkpoint keeps the inputs of layers 1-15 (layer
    # 0's is the embedding's output, a leaf AccumulateGrad holds either way): 15 x 4 MiB
    base = estimate(user_setup(**LLAMA_1B, ckpt_reentrant=True)).peak_allocated_bytes
    got = estimate(user_setup(**LLAMA_1B, ckpt_offload=name)).peak_allocated_bytes
    assert base - got == (15 - kept) * HIDDEN_BF16


def test_the_trace_runs_unsloths_function_and_keeps_the_same():
    from llmem.runtime.trace import trace

    base = trace(user_setup(**LLAMA_1B, ckpt_reentrant=True)).peak_allocated_bytes
    got = trace(user_setup(**LLAMA_1B, ckpt_offload="unsloth"))
    assert base - got.peak_allocated_bytes == 12 * HIDDEN_BF16
    assert any("--ckpt-offload unsloth" in n for n in got.notes)


@pytest.mark.parametrize("name", ["unsloth", "unsloth-single", "unsloth-classic"])
def test_the_copied_functions_give_the_layers_gradients(name):
    # real CPU tensors through the copied Functions around three "layers" (x * w + x, w = 1: each input exact in
    # bf16, as Unsloth stores an fp32 input): the gradients of an unchecked run, in the first step (all offloaded)
    # and the second (the last layer kept)
    from transformers.modeling_layers import GradientCheckpointingLayer

    from llmem.runtime.unsloth_ckpt import install_ckpt_offload

    class Layer(GradientCheckpointingLayer):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2048))

        def forward(self, x):
            return x * self.w + x

    torch.manual_seed(0)
    layers = torch.nn.ModuleList([Layer() for _ in range(3)])
    x = torch.randn(2, 512, 2048, dtype=torch.bfloat16).float()     # 8 MiB fp32, stored as bf16 exactly
    for layer in layers:
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = None
    install_ckpt_offload(layers, name)
    want = []
    for _step in range(2):
        h = x.clone().requires_grad_(True)
        for layer in layers:
            h = layer(h)
        h.sum().backward()
        got = [layer.w.grad.clone() for layer in layers]
        for layer in layers:
            layer.w.grad = None
        want.append(got)
    h = x.clone().requires_grad_(True)
    for layer in layers:
        layer.gradient_checkpointing = False
        h = layer(h)
    h.sum().backward()
    for got in want:
        for layer, g in zip(layers, got, strict=True):
            torch.testing.assert_close(g, layer.w.grad)


@pytest.mark.parametrize("flags, named", [
    (dict(ckpt_every=2), "--grad-ckpt-every"),
    (dict(offload_activations=True), "--offload-activations"),
    (dict(compile=True), "--compile"),
    (dict(ac_policy="op"), "--ac-policy op"),
])
def test_refused_with_what_it_is_not_modelled_with(flags, named):
    with pytest.raises(LlmemError, match=named):
        user_setup(model="tiny-llama", ckpt_offload="unsloth", **flags)


@pytest.mark.parametrize("argv", [
    ["--ckpt-offload", "bogus"],
    ["--ckpt-offload", "unsloth", "--method", "fsdp", "--gpus", "2"],
    ["--ckpt-offload", "unsloth", "--liger", "auto"],
])
def test_refused_in_one_line_on_the_command_line(capsys, argv):
    assert main(["estimate", "tiny-llama", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "--ckpt-offload" in err


def _read(tmp_path, data: dict):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return setup_from_file(str(path), model="tiny-llama")


LLAMAFACTORY = {"model_name_or_path": "tiny-llama", "stage": "sft", "do_train": True, "finetuning_type": "lora",
                "lora_rank": 8, "lora_target": "all", "cutoff_len": 1024, "per_device_train_batch_size": 1,
                "dataset": "x", "template": "llama3", "bf16": True}


def test_llamafactory_use_unsloth_gc_is_its_copy_of_the_classic_function(tmp_path):
    fs = _read(tmp_path, {**LLAMAFACTORY, "use_unsloth_gc": True})
    assert fs.setup.ckpt_offload == "unsloth-classic" and fs.setup.grad_ckpt and not fs.setup.offload_activations
    # disable_gradient_checkpointing: prepare_model_for_training never installs it
    fs = _read(tmp_path, {**LLAMAFACTORY, "use_unsloth_gc": True, "disable_gradient_checkpointing": True})
    assert fs.setup.ckpt_offload == "none" and not fs.setup.grad_ckpt


@pytest.mark.parametrize("cutoff, offload, reentrant", [(1024, "unsloth", True), (256, "none", True)])
def test_llamafactory_use_unsloth_loads_through_fastlanguagemodel(tmp_path, cutoff, offload, reentrant):
    # use_gradient_checkpointing="unsloth" with max_seq_length = cutoff_len: apply_unsloth_gradient_checkpointing
    # runs torch's checkpoint below 512; the kernels are named as not modelled, in one ignored entry
    fs = _read(tmp_path, {**LLAMAFACTORY, "use_unsloth": True, "cutoff_len": cutoff})
    assert fs.setup.ckpt_offload == offload and fs.setup.ckpt_reentrant is reentrant
    ignored = [i for i in fs.record.ignored if i.key == "use_unsloth"]
    assert len(ignored) == 1 and "not modelled" in ignored[0].why and ignored[0].approximates


AXOLOTL = {"base_model": "tiny-llama", "sequence_len": 256, "micro_batch_size": 1, "datasets": [{"path": "x"}],
           "adapter": "lora", "lora_r": 8, "lora_target_linear": True}


def test_axolotl_legacy_offloading_is_the_classic_function(tmp_path):
    fs = _read(tmp_path, {**AXOLOTL, "gradient_checkpointing": True, "activation_offloading": "legacy"})
    assert fs.setup.ckpt_offload == "unsloth-classic" and not fs.setup.offload_activations
    # the stream offloader (activation_offloading: true) stays activation offloading
    fs = _read(tmp_path, {**AXOLOTL, "gradient_checkpointing": True, "activation_offloading": True})
    assert fs.setup.ckpt_offload == "none" and fs.setup.offload_activations
    fs = _read(tmp_path, {**AXOLOTL, "gradient_checkpointing": True, "lora_mlp_kernel": True})
    assert [i.key for i in fs.record.ignored if "Unsloth" in i.why] == ["lora_mlp_kernel"]


@pytest.mark.parametrize("extra, named", [
    ({"gradient_checkpointing": "unsloth"}, "gradient_checkpointing"),     # not in axolotl's schema
    ({"gradient_checkpointing": True, "unsloth_lora_mlp": True}, "unsloth_lora_mlp"),   # removed, refused
])
def test_axolotl_refuses_what_axolotl_refuses(tmp_path, capsys, extra, named):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**AXOLOTL, **extra}))
    assert main(["estimate", "--from", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and named in err
