"""torchao's float8 training (torchao 0.18, torchao/float8): `convert_to_float8_training` swaps nn.Linear modules
for Float8Linear, whose matmuls run in float8 with dynamic scales; a recipe names the scaling.

What a recipe's Float8Linear does, as its code reads (float8_linear.py, matmul_with_hp_or_float8_args):
- forward saves the high-precision input and weight (`ctx.save_for_backward(input_hp, weight_hp_t)`), as
  nn.Linear does: no float8 copy is kept, whatever the recipe;
- each operand is cast anew for each of the three matmuls (float8_scaling_utils.hp_tensor_to_float8_dynamic): the
  input and the weight in forward; grad_output twice, the weight and the input once more in backward;
- tensorwise: one fp32 scale per tensor; rowwise (ScalingGranularity.AXISWISE): one fp32 scale per row of the
  dimension the matmul reduces over; rowwise_with_gw_hp: rowwise, with the weight gradient's matmul in bf16 (its
  two casts disabled).
Under FSDP2, `enable_fsdp_float8_all_gather` (tensorwise only: Float8LinearConfig refuses it otherwise) wraps each
converted weight in WeightWithDynamicFloat8CastTensor: its shard is cast to float8 before the all-gather and the
unsharded weight is a float8 tensor (1 byte an element), which forward and backward use without another cast.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.errors import LlmemError

FP8 = 1    # bytes of a float8_e4m3fn element


@dataclass(frozen=True)
class Float8Recipe:
    """One of torchao's Float8LinearRecipeName rows, as llmem models it."""
    name: str
    rowwise: bool               # AXISWISE scales (one per row) instead of one per tensor
    all_gather: bool            # enable_fsdp_float8_all_gather is allowed with it (tensorwise only)
    weight_grad_float8: bool = True   # the weight gradient's matmul casts grad_output and the input to float8


NONE = "none"
FLOAT8_RECIPES: dict[str, Float8Recipe] = {r.name: r for r in (
    Float8Recipe("tensorwise", rowwise=False, all_gather=True),
    Float8Recipe("rowwise", rowwise=True, all_gather=False),
    # cast_config_input_for_grad_weight and cast_config_grad_output_for_grad_weight DISABLED: the weight gradient
    # is a bf16 matmul of the tensors as they are (no second grad_output cast, no input cast)
    Float8Recipe("rowwise_with_gw_hp", rowwise=True, all_gather=False, weight_grad_float8=False),
)}

# torchtitan's float8 converter (torchtitan/components/quantization/float8.py, module_filter_fn) leaves out the
# output projection and any linear whose dims are not both multiples of 16 (torch._scaled_mm's constraint)
SKIPPED_MODULES = ("lm_head", "output")
DIM_MULTIPLE = 16


def float8_recipe(name: str) -> Float8Recipe | None:
    """--float8's recipe (None for "none"); an unknown name is refused."""
    if name == NONE:
        return None
    if name not in FLOAT8_RECIPES:
        raise LlmemError(f"unknown --float8 {name!r}: choose one of {NONE}, {', '.join(FLOAT8_RECIPES)}")
    return FLOAT8_RECIPES[name]


def check_float8(name: str, all_gather: bool) -> None:
    """--float8 and --float8-all-gather on their own (the rest of the set-up: llmem.setup.support)."""
    recipe = float8_recipe(name)
    if all_gather and recipe is None:
        raise LlmemError("--float8-all-gather needs --float8 tensorwise (it all-gathers Float8Linear's weights)")
    if all_gather and not recipe.all_gather:
        raise LlmemError(f"--float8-all-gather works with --float8 tensorwise only (torchao refuses it with "
                         f"{name}): drop --float8-all-gather or use --float8 tensorwise")


def converted(module_name: str, in_features: int, out_features: int) -> bool:
    """Whether torchtitan's filter converts this nn.Linear: not the output projection, both dims multiples of 16."""
    leaf = module_name.rsplit(".", 1)[-1]
    return leaf not in SKIPPED_MODULES and in_features % DIM_MULTIPLE == 0 and out_features % DIM_MULTIPLE == 0


def gathered_in_float8(setup, p) -> bool:
    """Whether FSDP2 all-gathers parameter `p` (a ParamInfo) in float8: --float8-all-gather on a converted linear's
    weight (WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather casts its shard; the unsharded weight is float8)."""
    return setup.float8_all_gather and p.module_kind == "Linear" and p.name.endswith(".weight") \
        and converted(p.name.removesuffix(".weight"), p.in_features, p.out_features)
