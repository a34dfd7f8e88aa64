"""The trace's emulation of peft's bitsandbytes LoRA layer (llmem.runtime.quant_kernels) honours disable_adapter()
as peft's lora/bnb.py Linear4bit.forward does: the base layer alone (no clone, no adapters). TRL's reference forward
of a LoRA policy runs under it (trl.trainer.utils.use_adapter(model, None)); the emulation ran the adapters there."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from llmem.runtime.quant_kernels import Linear4bitEmulated, wrap_quant_adapters


class OneLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x)


def test_disabled_adapters_run_the_base_layer_alone():
    torch.manual_seed(0)
    model = OneLinear()
    model.q = Linear4bitEmulated(model.q, torch.float32, double_quant=False)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q"]))
    assert wrap_quant_adapters(peft_model) == 1
    layer = peft_model.base_model.model.q
    calls: list[int] = []
    layer.lora_A["default"].register_forward_hook(lambda *args: calls.append(1))
    x = torch.randn(2, 64)
    peft_model(x)
    assert calls == [1]
    with peft_model.disable_adapter():    # (the emulation computes allocations, not values: no values compared)
        peft_model(x)
    assert calls == [1]                   # lora_A not run under disable_adapter
    peft_model(x)
    assert calls == [1, 1]                # and run again once the adapters are back
