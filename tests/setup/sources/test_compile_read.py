"""torch.compile as each framework's config turns it on: torchtune's `compile: True` (training.compile_model: each
decoder layer, and compile_loss: the loss) and torchtitan's `[compile]` (apply_compile on each block; components
default to the model and the loss) read as --compile, the loss's compile modelled for torchtune's chunked loss and
said to be not modelled otherwise; where --compile is not modelled with the rest of the file's set-up, the key
stays ignored (the layers run eagerly), not a refused file; the Trainer's whole-model `torch_compile` is not --compile."""

from __future__ import annotations

from documented_configs import DATA, approximate

from llmem.setup.sources import setup_from_file


def _torchtune(tmp_path, name: str, compile_line: str):
    text = (DATA / "torchtune" / name).read_text()
    assert "\ncompile: False" in text
    path = tmp_path / name
    path.write_text(text.replace("\ncompile: False", "\n" + compile_line))
    return setup_from_file(path)


def test_torchtune_compile_is_each_layer_compiled(tmp_path):
    fs = _torchtune(tmp_path, "full-single-device.yaml", "compile: True")
    assert fs.setup.compile is True
    used = {u.key: u.field for u in fs.record.used}
    assert used["compile"] == "compile"
    # its CEWithChunkedOutputLoss: compile_loss compiles compute_cross_entropy, modelled (llmem.runtime.compiled_loss)
    assert fs.setup.output_chunks > 0 and "compile (the loss)" not in approximate(fs)


def _unchunked(tmp_path, name: str, launch: str | None = None):
    """`name` with compile on, torch.nn.CrossEntropyLoss for its loss and (`launch`) its `tune run` recipe
    replaced."""
    _torchtune(tmp_path, name, "compile: True")
    text = (tmp_path / name).read_text().replace("torchtune.modules.loss.CEWithChunkedOutputLoss",
                                                 "torch.nn.CrossEntropyLoss")
    if launch is not None:          # "": no launch line at all
        text = "\n".join(line for line in text.splitlines() if "tune run" not in line) + "\n"
        text += f"# tune run {launch}\n" if launch else ""
    (tmp_path / name).write_text(text)
    return setup_from_file(tmp_path / name)


def test_torchtune_full_recipes_run_an_unchunked_loss_eagerly_under_compile(tmp_path):
    """full_finetune_single_device calls training.compile_loss(self._loss_fn) and drops what it returns: for a loss
    other than the chunked one, torch.compile(module) returns a new module and leaves the recipe's own as it was (the
    two checked here), so the loss runs eagerly, as the estimate runs it: no approximation."""
    import torch

    loss = torch.nn.CrossEntropyLoss()
    compiled = torch.compile(loss)
    assert compiled is not loss and type(loss) is torch.nn.CrossEntropyLoss and loss.forward.__self__ is loss
    fs = _unchunked(tmp_path, "full-single-device.yaml")
    assert fs.setup.compile is True and fs.setup.output_chunks == 0
    assert "compile (the loss)" not in approximate(fs)
    assert any(u.key == "compile (the loss)" and "eagerly" in u.note for u in fs.record.used)


def test_torchtune_lora_single_device_compiles_an_unchunked_loss_whole_not_modelled(tmp_path):
    """lora_finetune_single_device keeps compile_loss's value (self._loss_fn = ...): the whole loss compiled, which
    llmem does not model: said so; without a `tune run` line the recipe is unknown: said so too."""
    fs = _unchunked(tmp_path, "full-single-device.yaml", "lora_finetune_single_device --config x")
    assert "compile (the loss)" in approximate(fs)
    fs = _unchunked(tmp_path, "full-single-device.yaml", "")
    assert "compile (the loss)" in approximate(fs)


def test_torchtune_compile_off_stays_off(tmp_path):
    fs = _torchtune(tmp_path, "full-single-device.yaml", "compile: False")
    assert fs.setup.compile is False
    assert not {k for k in approximate(fs) if k.startswith("compile")}


def test_torchtune_qlora_compile_is_each_layer_compiled_over_the_nf4_base(tmp_path):
    """torchtune's QLoRA recipe compiles its layers over torchao's NF4Tensor weights (the dequantisation traced into
    each layer's graph): read as --compile, not an ignored key."""
    fs = _torchtune(tmp_path, "qlora-single-device.yaml", "compile: True")
    assert fs.setup.compile is True and fs.setup.quant_base == "torchao-nf4"
    assert "compile" not in {i.key for i in fs.record.ignored}


def _titan_without_float8() -> str:
    text = (DATA / "torchtitan" / "float8-compile.toml").read_text()
    assert 'converters = ["float8"]\n' in text
    return text.replace('converters = ["float8"]\n', "")


def test_torchtitan_compile_without_the_loss(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(_titan_without_float8().replace("enable = true", 'enable = true\ncomponents = ["model"]'))
    fs = setup_from_file(path)
    assert fs.setup.compile is True
    assert approximate(fs) == set()                        # the file's run as read


def test_torchtitan_compile_of_the_loss_only_is_not_the_layers(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(_titan_without_float8().replace("enable = true", 'enable = true\ncomponents = ["loss"]'))
    fs = setup_from_file(path)
    assert fs.setup.compile is False
    assert "compile.components" in approximate(fs)


def test_torchtitan_compile_with_selective_ac_runs_eagerly_said_so(tmp_path):
    text = (DATA / "torchtitan" / "fsdp-8b.toml").read_text()
    assert "enable = false" in text and 'selective_ac_option = "op"' in text
    path = tmp_path / "c.toml"
    path.write_text(text.replace("enable = false", "enable = true"))
    fs = setup_from_file(path)
    assert fs.setup.compile is False and fs.setup.ac_policy == "op"
    assert {"compile.enable", "compile.components"} <= approximate(fs)


def test_the_trainers_whole_model_compile_is_not_layer_compile(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text("model_name_or_path: meta-llama/Llama-3.1-8B\nper_device_train_batch_size: 1\n"
                    "max_length: 512\nbf16: true\ntorch_compile: true\n")
    fs = setup_from_file(path)
    assert fs.setup.compile is False
    assert approximate(fs) == {"torch_compile"}
