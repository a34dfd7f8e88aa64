"""The one support check: what a set-up's options need of its method, raised by every engine once the method is
resolved (so a planner can build the set-up and skip the layouts that cannot run it, with the same message)."""

from __future__ import annotations

from llmem.errors import LlmemError
from llmem.setup.methods import METHODS, MethodSpec
from llmem.setup.training import QUANT_FLAGS, TrainingSetup


def check_support(setup: TrainingSetup, method: MethodSpec) -> None:
    """Raise LlmemError naming the first option that `method`'s real code path does not support."""
    if setup.optimizer_in_backward and setup.offload_optimizer:
        raise LlmemError("--optimizer-in-backward and --offload-optimizer cannot be combined")
    if setup.optimizer_in_backward and not method.steps_in_backward:
        able = ", ".join(m.name for m in METHODS.values() if m.steps_in_backward)
        raise LlmemError(f"--optimizer-in-backward is supported with method {able} only (got {method.name}): DDP "
                         "and FSDP2 reduce gradients after accumulation (a post-accumulate-grad hook would step "
                         "on unreduced gradients, or never fire on FSDP2's sharded parameters); TP is not "
                         "modelled")
    optimizer = setup.optimizer_spec
    if optimizer.plain_tensors_only and not method.plain_tensors:
        raise LlmemError(optimizer.plain_tensors_only.format(name=optimizer.name, method=method.name))
    if optimizer.tp_refusal and method.has_tp:
        raise LlmemError(optimizer.tp_refusal.format(name=optimizer.name, method=method.name))
    if setup.peft and method.has_tp:
        raise LlmemError("LoRA / peft with tensor parallelism is not modelled: use single, ddp, fsdp or zero2")
    if setup.fused_ce and method.has_tp:
        raise LlmemError("--fused-ce with tensor parallelism is not modelled: the vocab-parallel lm_head needs a "
                         "vocab-parallel loss")
    if setup.quant_base != "none" and not method.plain_tensors:
        raise LlmemError(f"{QUANT_FLAGS[setup.quant_base]} with {method.name}: a bitsandbytes-quantised base is "
                         "modelled on one GPU or under DDP (FSDP2 over quantised storage, as FSDP-QLoRA runs it, and "
                         "TP are not modelled)")
