"""peft's adapter parameters read from their names (llmem.model.adapter_params), on the names peft itself gives a
LoRA, DoRA and IA3 model."""

from __future__ import annotations

from llmem.model.adapter_params import (
    IA3_L,
    LORA_A,
    LORA_B,
    adapted_module,
    adapter_part,
    is_adapter_param,
    partner,
    reads_module_input,
)

LAYER = "base_model.model.model.layers.0"


def test_lora_parameters_name_their_part_and_module():
    a = f"{LAYER}.self_attn.q_proj.lora_A.default.weight"
    assert adapter_part(a) is LORA_A
    assert adapter_part(f"{LAYER}.self_attn.q_proj.lora_B.default.weight") is LORA_B
    assert adapted_module(a) == "q_proj"
    assert partner(a, LORA_B) == f"{LAYER}.self_attn.q_proj.lora_B.default.weight"


def test_ia3_vectors_read_the_input_only_on_a_feed_forward_input():
    down = f"{LAYER}.mlp.down_proj.ia3_l.default"
    assert adapter_part(down) is IA3_L
    assert adapted_module(down) == "down_proj"
    assert reads_module_input(down, (1, 11008))          # [1, in]: scales down_proj's input
    assert not reads_module_input(f"{LAYER}.self_attn.k_proj.ia3_l.default", (1024, 1))   # [out, 1]: its output
    assert reads_module_input(f"{LAYER}.self_attn.q_proj.lora_A.default.weight", (8, 4096))
    assert not reads_module_input(f"{LAYER}.self_attn.q_proj.lora_B.default.weight", (4096, 8))


def test_every_tuner_parameter_is_an_adapter_and_the_base_layer_is_not():
    assert is_adapter_param(f"{LAYER}.self_attn.q_proj.lora_magnitude_vector.default.weight")     # DoRA
    assert is_adapter_param(f"{LAYER}.self_attn.q_proj.lora_A.default.weight")
    assert is_adapter_param(f"{LAYER}.mlp.down_proj.ia3_l.default")
    assert not is_adapter_param(f"{LAYER}.self_attn.q_proj.base_layer.weight")
    assert adapter_part(f"{LAYER}.self_attn.q_proj.lora_magnitude_vector.default.weight") is None
    assert adapter_part(f"{LAYER}.self_attn.q_proj.base_layer.weight") is None
