"""torchao's float8 training in the traced step: `convert_to_float8_training` with the recipe's Float8LinearConfig
and torchtitan's module filter (llmem.setup.float8), so that the step runs torchao's own Float8Linear, its casts and
torch._scaled_mm (whose meta kernel runs on fake tensors) before FSDP2 shards the model."""

from __future__ import annotations

from dataclasses import replace

from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from llmem.errors import LlmemError
from llmem.setup.float8 import converted, float8_recipe

INSTALL_HINT = "pip install 'llmem[float8]' (torchao)"


def install_float8(model: nn.Module, recipe_name: str, all_gather: bool) -> int:
    """Swap `model`'s nn.Linear modules that the filter converts for Float8Linear; returns how many were swapped."""
    recipe = float8_recipe(recipe_name)
    if recipe is None:
        return 0
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        raise LlmemError(f"--float8 is traced with torchao's Float8Linear, which is not installed: {INSTALL_HINT}") \
            from None
    config = Float8LinearConfig.from_recipe_name(recipe.name)
    if all_gather:
        config = replace(config, enable_fsdp_float8_all_gather=True)

    def keep(module: nn.Module, fqn: str) -> bool:
        return converted(fqn, module.in_features, module.out_features)

    with unset_fake_temporarily():   # the meta model: WeightWithDynamicFloat8CastTensor reads is_pinned() of it
        convert_to_float8_training(model, config=config, module_filter_fn=keep)
    return sum(isinstance(m, Float8Linear) for m in model.modules())


def rewrap_float8_weights(model: nn.Module) -> None:
    """Fake materialisation makes plain parameters: wrap each float8-all-gathered weight again as
    Float8Linear.from_float does (WeightWithDynamicFloat8CastTensor), before FSDP2 shards it."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    for m in model.modules():
        if not isinstance(m, Float8Linear) or not m.config.enable_fsdp_float8_all_gather \
                or isinstance(m.weight, WeightWithDynamicFloat8CastTensor):
            continue
        wrapped = WeightWithDynamicFloat8CastTensor(m.weight, m.linear_mm_config, m.config.cast_config_weight.target_dtype)
        m.weight = nn.Parameter(wrapped, requires_grad=m.weight.requires_grad)
