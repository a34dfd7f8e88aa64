"""What a result says besides its numbers: the assumptions behind them. The optimizer's and the activation options'
notes are shared with the trace and measure (the real step), the rest is the estimate's own."""

from __future__ import annotations

from llmem.memory.activations.profile import ActivationProfile, activation_notes, has_recipe
from llmem.memory.quant import is_quantised, storage_bytes
from llmem.model.anatomy import ModelAnatomy
from llmem.model.resolved import ResolvedSetup
from llmem.setup.training import TrainingSetup
from llmem.units import GIB


def quant_notes(setup: TrainingSetup, anatomy: ModelAnatomy) -> list[str]:
    """What the estimate says about a bitsandbytes-quantised base (its kernels are modelled, never run)."""
    if setup.quant_base == "none":
        return []
    quantised = [p for p in anatomy.params if is_quantised(p, setup.quant_base)]
    stored = sum(storage_bytes(p, setup.quant_base, setup.double_quant) for p in quantised)
    numel = sum(p.numel for p in quantised)
    kind = ("NF4 4-bit" + (", double-quantised constants" if setup.double_quant else ", fp32 absmax")
            if setup.quant_base == "nf4" else "LLM.int8")
    upcast = sum(p.numel for p in anatomy.params if not p.trainable and not is_quantised(p, setup.quant_base))
    notes = [f"bitsandbytes {kind} base: {numel / 1e9:.2f} B parameters in {stored / GIB:.2f} GiB "
             f"({8 * stored / max(numel, 1):.3f} bits each); bitsandbytes' kernels are modelled, not run "
             "(dequantisation transients in forward and backward included)",
             f"QLoRA recipe (peft's prepare_model_for_kbit_training): the {upcast / 1e9:.2f} B unquantised frozen "
             "parameters (embeddings, norms, lm_head) are fp32, and so is the residual stream"]
    if anatomy.family != "llama" and setup.mixed:
        notes.append(f"activations behind bitsandbytes' fp32-returning linears are modelled for the Llama family; "
                     f"for {anatomy.model_type!r} they are approximate (llmem trace gives the step)")
    return notes


def estimate_notes(r: ResolvedSetup, act: ActivationProfile, offloaded_host_bytes: int) -> list[str]:
    """Every note of an estimate, in the order the result lists them. `offloaded_host_bytes`: the optimizer's host
    RAM per GPU under --offload-optimizer."""
    setup, anatomy = r.setup, r.anatomy
    notes = setup.optimizer_spec.notes("estimate", setup.optimizer_in_backward)
    if r.layout.shards_model_states:
        notes += setup.optimizer_spec.sharded_notes
    if setup.offload_optimizer:
        notes.append(f"optimizer states offloaded: the CPU needs about {offloaded_host_bytes / GIB:.1f} GiB of RAM "
                     "per GPU for them and the fp32 master copy of the trained parameters")
    notes += [n for n in (anatomy.positions_note(setup.seq_len), anatomy.varied_layers_note) if n is not None]
    notes += quant_notes(setup, anatomy)
    if not has_recipe(anatomy):
        notes.append(f"no activation recipe for model_type {anatomy.model_type!r}: the Llama recipe is used, so "
                     "activations are approximate (llmem trace gives the exact step)")
    notes.extend(activation_notes(setup))
    if act.offload:
        notes.append(f"activations offloaded: about {act.offloaded_bytes / GIB:.2f} GiB of pinned host memory per GPU")
    if anatomy.peft is not None:
        notes.extend(anatomy.peft.notes)
        if anatomy.peft.use_dora and setup.quant_base != "none":
            notes.append("DoRA on a quantised base: its weight norms are modelled as for an unquantised one (the "
                         "dequantised weight each forward), not checked against the trace")
    if not anatomy.supports_sdpa and setup.attn == "sdpa":
        notes.append(f"{anatomy.architecture} has no SDPA implementation in transformers: eager attention assumed")
    return notes
