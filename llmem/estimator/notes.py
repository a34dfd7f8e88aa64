"""What a result says besides its numbers: the assumptions behind them. The optimizer's and the activation options'
notes are shared with the trace and measure (the real step), the rest is the estimate's own."""

from __future__ import annotations

from llmem.estimator.deepspeed import two_forwards_note
from llmem.estimator.objectives import reference_bytes
from llmem.estimator.post_forward import post_forward_layer_bytes, post_forward_ranks
from llmem.estimator.states import cpu_offload, cpu_offload_host_bytes
from llmem.memory.activations.ckpt_offload import ckpt_offload_note, offloaded_checkpoint
from llmem.memory.activations.learned import activation_source_notes, learned_for
from llmem.memory.activations.profile import ActivationProfile, activation_notes
from llmem.memory.quant import is_quantised, quant_args, quant_layout, storage_bytes
from llmem.model.anatomy import ModelAnatomy
from llmem.model.moe import routing_notes
from llmem.model.resolved import ResolvedSetup
from llmem.model.vision_inputs import vision_inputs
from llmem.setup.context_parallel import cp_note
from llmem.setup.deepspeed import AUTO, bucket_buffers, reference_engine_note, zero_config
from llmem.setup.expert_parallel import ep_note
from llmem.setup.gpus import AUTO_GPU
from llmem.setup.layout import Layout
from llmem.setup.objectives import REF_COPY, objective_notes, objective_spec, reference_mode
from llmem.setup.training import TrainingSetup
from llmem.units import GIB


def quant_notes(setup: TrainingSetup, anatomy: ModelAnatomy, layout: Layout | None = None) -> list[str]:
    """What the estimate says about a quantised base: its storage, who runs it that way, the kbit upcast (its kernels
    are modelled, never run)."""
    if not setup.quant_spec.quantised:
        return []
    q = quant_layout(setup.quant_base)
    bnb = setup.quant_spec.bitsandbytes
    shards = layout.shard_degree if layout is not None else 1
    args = quant_args(setup, shards > 1)
    quantised = [p for p in anatomy.params if is_quantised(p, setup.quant_base)]
    stored = sum(storage_bytes(p, setup.quant_base, args) for p in quantised)
    numel = sum(p.numel for p in quantised)
    dtype = setup.compute_dtype.replace("bfloat", "bf").replace("float", "fp")
    kind = q.storage_text(setup.double_quant)
    size = (f"{q.library} {kind} base: {numel / 1e9:.2f} B parameters in {stored / GIB:.2f} GiB "
            f"({8 * stored / max(numel, 1):.3f} bits each)")
    if shards > 1:
        size += (f", the packed weights (in {dtype}: bnb_4bit_quant_storage, the FSDP-QLoRA recipe) sharded by FSDP2 "
                 f"over {shards} GPUs, the quantisation state replicated" if bnb else
                 f", quantized_data / scalers / factors sharded by FSDP2 over {shards} GPUs and all-gathered per "
                 "layer in their own dtypes (fsdp_pre_all_gather), scaler_mean and the nf4 table replicated")
    if not bnb:
        notes = [size + ("; --compile: its dequantisation (get_original_weight) is ops of each compiled layer's "
                         "graph, what it saves and allocates learned with the layer (the partitioned graphs run op by "
                         "op: an upper bound of inductor's fused kernels)" if setup.compile else
                         "; torchao's dequantisation (get_original_weight in eager mode: int64 nibble planes, about "
                         "7x the weight for a moment, in forward and again in backward) is modelled, not run"),
                 f"torchtune's QLoRA (LoRALinear(quantize_base=True)): no prepare_model_for_kbit_training, so the "
                 f"embeddings, norms and output projection stay in {dtype}, and the adapters are in the model dtype"]
    else:
        notes = [size + "; bitsandbytes' kernels are modelled, not run (dequantisation transients in forward and "
                 "backward included)"]
        upcast = sum(p.numel for p in anatomy.params if not p.trainable and not is_quantised(p, setup.quant_base))
        if setup.kbit_upcasts:
            notes.append(f"QLoRA recipe (peft's prepare_model_for_kbit_training, as HF/TRL run it on one GPU or "
                         f"DDP): the {upcast / 1e9:.2f} B unquantised frozen parameters (embeddings, norms, "
                         "lm_head) are fp32, and so is the residual stream" + (
                             "; without autocast every activation is then fp32 (only bitsandbytes' matmuls run in "
                             f"{dtype})" if not setup.mixed and setup.precision_spec.low_precision else ""))
            if shards > 1:
                notes.append("TRL's SFTTrainer and axolotl skip prepare_model_for_kbit_training for FSDP-QLoRA: "
                             "--no-kbit-upcast models their run")
        else:
            notes.append(f"no prepare_model_for_kbit_training (--no-kbit-upcast, as TRL and axolotl run "
                         f"FSDP-QLoRA): the {upcast / 1e9:.2f} B unquantised frozen parameters stay in {dtype}")
    if anatomy.family != "llama" and setup.mixed and bnb and setup.kbit_upcasts:
        notes.append(f"activations behind bitsandbytes' fp32-returning linears are modelled for the Llama family; "
                     f"for {anatomy.model_type!r} they are approximate (llmem trace gives the step)")
    return notes


def deepspeed_notes(r: ResolvedSetup, host_bytes: int) -> list[str]:
    """What a ds-zero estimate assumed of DeepSpeed's engine: its ZeRO knobs as resolved, the buffers they make."""
    setup, hidden = r.setup, r.anatomy.hidden_size
    zero = zero_config(setup, r.method.zero_stage, hidden)
    auto = " (auto: hidden_size^2)" if setup.reduce_bucket_size == AUTO else \
        "" if setup.reduce_bucket_size is not None else " (DeepSpeed's default)"
    bucket_gib = bucket_buffers(zero) * zero.reduce_bucket_size * setup.compute_bytes / GIB
    notes = [f"DeepSpeed ZeRO-{zero.stage} as DeepSpeed's engine runs it (deepspeed 0.19): the module cast to "
             f"{setup.compute_dtype.replace('bfloat', 'bf').replace('float', 'fp')} (no autocast), an fp32 master "
             f"partition and the optimizer's states over it; {bucket_buffers(zero)} IPG buffer(s) of "
             f"reduce_bucket_size {zero.reduce_bucket_size:,} elements{auto} = {bucket_gib:.2f} GiB, overlap_comm "
             f"{'on' if zero.overlap_comm else 'off'}; one parameter group (HF's Trainer makes two: a few bytes "
             "more alignment)"]
    if zero.stage == 3:
        notes.append(f"ZeRO-3's coordinator, per decoder layer: prefetch {zero.prefetch_bucket_size:,} elements, "
                     f"persistence threshold {zero.param_persistence_threshold:,}, max live "
                     f"{zero.max_live_parameters:,}, reuse distance {zero.max_reuse_distance:,} (from the second "
                     "step, layers used again within it stay gathered)")
    if zero.offload_optimizer or zero.offload_param:
        what = " and ".join(w for w, on in (("optimizer", zero.offload_optimizer), ("parameters", zero.offload_param))
                            if on)
        notes.append(f"DeepSpeed offload of the {what}: about {host_bytes / GIB:.1f} GiB of pinned CPU RAM per GPU")
    return notes


def cpu_offload_note(r: ResolvedSetup) -> str:
    """What FSDP2's CPUOffloadPolicy leaves on the device, and the host RAM it needs per GPU and per node."""
    host = cpu_offload_host_bytes(r)
    per_node = r.layout.gpus_per_node
    implied = "" if r.setup.offload_optimizer else "; --offload-optimizer is implied (FSDP2 has no optimizer-only " \
        "offload)"
    return (f"FSDP2 CPUOffloadPolicy(pin_memory=True): the sharded parameters and gradients in pinned host memory "
            f"({host.pinned / GIB:.1f} GiB per GPU), the optimizer steps them on the host ({host.optimizer / GIB:.1f} "
            f"GiB of states and one parameter's step temporaries){implied}; CPU RAM about "
            f"{host.total / GIB:.1f} GiB per GPU, {host.total * per_node / GIB:.1f} GiB per node of {per_node} GPUs. "
            "On the device: the gathered units, their unsharded gradients until the reduce-scatter, each shard's "
            "copy from the host before its all-gather and the reduce-scatter output until its copy to the host"
            + ("; a quantised weight's quantisation state (absmax and constants, not FSDP2's sharded parameter) stays "
               "on the device" if r.setup.quant_spec.quantised else ""))


def estimate_notes(r: ResolvedSetup, act: ActivationProfile, offloaded_host_bytes: int) -> list[str]:
    """Every note of an estimate, in the order the result lists them. `offloaded_host_bytes`: the optimizer's host
    RAM per GPU under --offload-optimizer."""
    setup, anatomy = r.setup, r.anatomy
    notes = setup.optimizer_spec.notes("estimate", setup.optimizer_in_backward)
    if setup.gpu.lower() == AUTO_GPU:      # the local GPU's free memory as the capacity (llmem.setup.gpus.auto_gpu)
        notes.append(r.gpu.memory_source)
    if r.layout.ep > 1:    # torchtitan's expert parallelism (llmem.setup.expert_parallel)
        notes.append(ep_note(r.layout.ep, r.layout.expert_shard_degree, setup.ep_imbalance, "estimate"))
    if post_forward_ranks(r):    # FSDP2's reshard_after_forward=N (llmem.estimator.post_forward)
        n = post_forward_ranks(r)
        notes.append(f"--reshard-after-forward {n}: after its forward each decoder layer keeps 1/{n} of its gathered "
                     f"parameters ({post_forward_layer_bytes(r) / GIB:.3f} GiB a layer, in the all-gather dtype) "
                     f"until its backward all-gathers them over {n} ranks (the root stays gathered)")
    if r.layout.cp > 1:    # r: the rank's set-up (its seq_len / cp tokens)
        notes.append(cp_note(r.layout.cp, setup.seq_len * r.layout.cp, "estimate"))
    notes += objective_notes(setup)       # TRL's trainer: its batch layout, its loss, the reference and its cost
    if reference_mode(setup) == REF_COPY:
        shards = r.layout.shard_degree if r.layout.shards_model_states else 1
        if r.method.zero_stage == 3:      # its prepare_deepspeed engine partitions it (reference_engine_note)
            shards = r.layout.dp
        sharded = "" if shards == 1 or r.method.zero_stage is not None else (
            " (its FSDP2 shard: trl's prepare_fsdp makes the whole copy one unit, all-gathered for its forward, "
            "when the unsharded copy and the all-gather output both live,"
            + (" and resharded after it)" if r.method.reshard_after_forward else " and kept gathered after it: zero2)"))
        notes.append(f"the reference copy costs {anatomy.total_params * reference_bytes(r) / shards / GIB:.2f} GiB "
                     f"of weights per GPU{sharded}, resident through the step (no gradients, no optimizer states); "
                     + ("--beta 0" if objective_spec(setup.objective).generates else "--precompute-ref-log-probs")
                     + " or LoRA (adapters disabled) drop it")
    if r.layout.shards_model_states:
        notes += setup.optimizer_spec.sharded_notes
    if r.method.zero_stage is not None:
        notes += deepspeed_notes(r, offloaded_host_bytes)
        if r.setup.objective_spec.keeps_reference:   # TRL's reference
            notes.append(reference_engine_note(r.method.zero_stage, reference_mode(r.setup) == REF_COPY))
        notes += [n for n in (two_forwards_note(r),) if n is not None]     # llmem.estimator.deepspeed
    elif cpu_offload(r):
        notes.append(cpu_offload_note(r))
    elif setup.offload_optimizer:
        notes.append(f"optimizer states offloaded: the CPU needs about {offloaded_host_bytes / GIB:.1f} GiB of RAM "
                     "per GPU for them and the fp32 master copy of the trained parameters")
    notes += [n for n in (anatomy.positions_note(setup.seq_len), anatomy.varied_layers_note) if n is not None]
    images = vision_inputs(setup, r.base)      # a vision-language model's images (llmem.model.vision_inputs)
    if images is not None:
        notes.append(images.describe())
    notes += routing_notes(anatomy, learned=learned_for(r) is not None, ep=r.layout.ep)     # MoE: the routing assumption
    notes += quant_notes(setup, anatomy, r.layout)
    notes += activation_source_notes(r)     # learned from the real code, or the fallback recipe and why
    notes.extend(activation_notes(setup))
    if act.offload:
        notes.append(f"activations offloaded: about {act.offloaded_bytes / GIB:.2f} GiB of pinned host memory per GPU")
    oc = offloaded_checkpoint(setup.ckpt_offload, act.ckpt_input_bytes, r.regime.res)
    if oc is not None:
        notes.append(ckpt_offload_note(oc, act.checkpointed_layers()))
    if anatomy.peft is not None:
        notes.extend(anatomy.peft.notes)
        if anatomy.peft.use_dora and setup.quant_spec.quantised:
            notes.append("DoRA on a quantised base: its weight norms are modelled as for an unquantised one (the "
                         "dequantised weight each forward), not checked against the trace")
    if not anatomy.supports_sdpa and setup.attention_spec.without_sdpa != setup.attn:
        notes.append(f"{anatomy.architecture} has no SDPA implementation in transformers: eager attention assumed")
    return notes
