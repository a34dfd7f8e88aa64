"""Activation memory of one training step, per GPU: the activation profile of a resolved set-up (what the forward
keeps per decoder layer, per block, outside the layers, and at the loss), built from its family's recipe and the
set-up's adapters, quantised base, loss, checkpointing and offloading."""

from __future__ import annotations

from dataclasses import dataclass

from llmem.memory.activations.adapters import (
    adapters_read_input,
    adapters_upcast,
    first_layer_skip,
    with_adapters,
    with_trainability,
)
from llmem.memory.activations.blocks import (
    Block,
    Dims,
    LayerRecipe,
    Sizes,
    config_value,
    loss_peak_bytes,
    packed_mask_bytes,
)
from llmem.memory.activations.context_parallel import with_ring_attention
from llmem.memory.activations.embedding_adapter import embedding_adapter_kept, embedding_adapters
from llmem.memory.activations.float8 import with_float8
from llmem.memory.activations.learned import (
    learned_cross_blocks,
    learned_recipe,
    learned_selective,
    learned_vision,
    learning_failure,
)
from llmem.memory.activations.learned_vision import VisionStep
from llmem.memory.activations.liger import with_liger
from llmem.memory.activations.loss import ChunkedOutput, FusedCE, LossLogits, fused_ce_for, loss_logits
from llmem.memory.activations.quantised import (
    adapter_regime,
    fp32_behind_quant,
    int8_inputs_kept,
    quant_adapters_downcast,
    quant_adapters_upcast,
    with_fp32_mlp,
    with_int8_inputs,
)
from llmem.memory.activations.recipes import recipe_for
from llmem.memory.activations.selective import SelectiveLayer, selective_layer
from llmem.memory.quant import quant_layout
from llmem.model.adapter_params import is_adapter_param, is_embedding_adapter
from llmem.model.anatomy import ModelAnatomy
from llmem.model.families import family_of
from llmem.model.resolved import ResolvedSetup
from llmem.model.sharding import is_embedding, is_lm_head
from llmem.model.vision import (
    LANGUAGE,
    cross_attention_layers,
    part_of,
    tower_units,
    vision_modules,
    vision_root,
    vision_spec,
)
from llmem.model.vision_inputs import VisionInputs, vision_inputs
from llmem.setup.attention import ATTENTIONS, AttentionSpec
from llmem.setup.checkpointing import AC_POLICIES
from llmem.setup.float8 import FLOAT8_RECIPES
from llmem.setup.liger import AUTO, applied_kernels
from llmem.setup.precision import Regime
from llmem.setup.training import TrainingSetup


@dataclass(frozen=True)
class LayerKinds:
    """Decoder layers of a second kind (Llama 3.2 Vision's cross-attention layers among its self-attention ones,
    learned: LearnedActivations.cross_blocks): their blocks and which layers are of that kind (the profile's `blocks`
    are every other layer's), and the leading layers that run without a graph (before the first cross-attention
    layer, nothing below it trained: they keep nothing and run no backward; graphless_layers)."""
    cross_blocks: tuple[Block, ...] = ()
    cross_layers: frozenset[int] = frozenset()
    graphless_layers: int = 0

    @property
    def cross_saved(self) -> int:
        return sum(b.saved for b in self.cross_blocks)


@dataclass(frozen=True)
class ActivationProfile:
    """What the forward keeps, and the transient peaks around it, in bytes per GPU."""
    per_layer_saved: int       # kept for backward by one decoder layer (its input included), no checkpointing
    checkpoint_saved: int      # kept per layer under gradient checkpointing (the layer input)
    embed_saved: int           # kept by the embedding block (outside the layers)
    shared_saved: int          # shared by every layer: rotary cos/sin, attention mask
    loss_peak: int             # logits, their fp32 upcast, log-softmax and their gradients at the loss backward
    blocks: tuple[Block, ...]  # one decoder layer, forward order
    grad_ckpt: bool
    layers: int
    embed_tensors: tuple[int, ...] = ()
    head_tensors: tuple[int, ...] = ()
    head_back: tuple[tuple[int, int, int], ...] = ()   # the final norm's backward events (LayerRecipe.head_back)
    mask_bytes: int = 0        # --packing under SDPA: the boolean mask, live during the forward
    shared_tensors: tuple[int, ...] = ()
    int8_kept: tuple[int, ...] = ()   # checkpointing: inputs LLM.int8 keeps per layer (in checkpoint_saved)
    ckpt_every: int = 1        # with grad_ckpt: layers whose index % ckpt_every == 0 are checkpointed
    fused_ce: FusedCE | None = None   # the fused linear cross-entropy's tensors (None: HF's loss on full logits)
    offload: bool = False      # saved tensors of the layers (checkpointed layers' inputs too) and the final norm
                               # on the host
    first_layer_skip: int = 0  # leading blocks of layer 0 that keep nothing (their inputs need no gradient)
    # checkpointing with a frozen token embedding: transformers' activation_checkpointing_enable calls
    # enable_input_require_grads, whose hook makes the embedding output a leaf that requires grad; its AccumulateGrad
    # node holds it (offloaded or not) until the graph dies after backward, and gives it a .grad at layer 0's backward
    embed_leaf_bytes: int = 0
    lm_head_kept: bool = True  # the last head tensor is the lm_head's input (not when the fused loss or a frozen
                               # lm_head keeps none)
    # --ac-policy op: the op outputs each checkpointed layer's storage keeps (in checkpoint_saved); None: full
    selective: SelectiveLayer | None = None
    loss: LossLogits = LossLogits()   # the logits the loss reads: their dtype, autocast's cast, torchtune's chunks
    # --compile: the layers' autocast weight copies are ops of their compiled graphs (saved or recomputed as the
    # partitioner chose, learned with the layer), not autocast's cached casts the schedule makes
    compiled: bool = False
    vision: VisionStep | None = None   # a vision-language step: its batch, vision modules and learned vision side
    kinds: LayerKinds = LayerKinds()   # decoder layers of two kinds (Llama 3.2 Vision's): the second kind's

    def skipped(self, layer: int) -> int:
        """The leading blocks of decoder layer `layer` that keep nothing (their inputs need no gradient): every block
        of a graphless layer, layer 0's before its first adapter (first_layer_skip)."""
        if layer < self.kinds.graphless_layers:
            return len(self.blocks_of(layer))
        return self.first_layer_skip if layer == 0 else 0

    def blocks_of(self, layer: int) -> tuple[Block, ...]:
        """Decoder layer `layer`'s blocks: its kind's."""
        return self.kinds.cross_blocks if layer in self.kinds.cross_layers else self.blocks

    def saved_of(self, layer: int) -> int:
        """What decoder layer `layer` keeps for backward, not checkpointed (its input included; none in a graphless
        layer)."""
        if layer < self.kinds.graphless_layers:
            return 0
        return self.kinds.cross_saved if layer in self.kinds.cross_layers else self.per_layer_saved

    @property
    def loss_bytes(self) -> int:
        """The loss's logits, log-softmax and gradients: bytes per element."""
        return self.loss.element_bytes

    @property
    def nll_cast(self) -> int:
        return self.loss.nll_cast

    @property
    def chunked(self) -> ChunkedOutput | None:
        return self.loss.chunked

    def checkpointed(self, layer: int) -> bool:
        """HF `_set_gradient_checkpointing(every_n_layers=k)`: decoder layer i is checkpointed when i % k == 0; the
        others keep all their tensors. (torchtune's selective "every k-th layer", training/activations.py 0.6,
        counts from 1 and wraps layers with (i + 1) % k == 0: the same number when k divides the depth, but the
        top layer is then checkpointed; llmem follows transformers, whose step it runs.)"""
        return self.grad_ckpt and layer % self.ckpt_every == 0

    def checkpointed_layers(self, layers: int | None = None) -> int:
        """How many of the first `layers` decoder layers are checkpointed: ceil(layers / k)."""
        n = self.layers if layers is None else layers
        return -(-n // self.ckpt_every) if self.grad_ckpt else 0

    def layers_saved(self, layers: int | None = None) -> int:
        """Bytes kept for backward by the first `layers` decoder layers at the end of the forward."""
        n = self.layers if layers is None else layers
        ck = self.checkpointed_layers(n)
        if not self.kinds.cross_layers:
            return ck * self.checkpoint_saved + (n - ck) * self.per_layer_saved
        return ck * self.checkpoint_saved + sum(self.saved_of(i) for i in range(n) if not self.checkpointed(i))

    @property
    def embed_leaf_apart(self) -> bool:
        """Whether the schedule lays out a frozen embedding's output under checkpointing (`embed_leaf_bytes`: a leaf
        its AccumulateGrad node holds on the device) on its own: with offloading, or when a vision-language model
        scatters its image features into it (layer 0's input is then the scatter's output); otherwise it is layer
        0's checkpointed input, counted there."""
        return self.offload or self.vision is not None

    @property
    def ckpt_input_bytes(self) -> int:
        """The layer input a checkpointed layer saves (torch.utils.checkpoint's non-reentrant `save_inputs`: the
        positional tensor arguments, which transformers' GradientCheckpointingLayer passes as the hidden states
        alone; masks and rotary cos/sin are keywords, bound in the recompute's partial, not saved)."""
        return self.checkpoint_saved - sum(self.int8_kept) - self.selective_kept_bytes

    @property
    def selective_kept_bytes(self) -> int:
        """--ac-policy op: what a checkpointed layer's storage keeps besides its input (llmem.memory.activations
        .selective); 0 under full checkpointing."""
        return self.selective.kept_bytes(self.blocks) if self.selective is not None else 0

    @property
    def selective_held_bytes(self) -> int:
        """--ac-policy op: stored outputs the recompute never reads, live through the layer's backward."""
        return self.selective.held_bytes if self.selective is not None else 0

    @property
    def ckpt_device_saved(self) -> int:
        """What a checkpointed layer keeps on the device between forward and backward: its input, unless offloaded
        (`save_inputs` packs it through the saved-tensor hooks outside the checkpoint's own, so torchtune's
        OffloadActivations moves it to the host); LLM.int8's ctx attributes are not saved tensors and stay."""
        return sum(self.int8_kept) if self.offload else self.checkpoint_saved

    @property
    def recompute_input_bytes(self) -> int:
        """Offloaded checkpointing: the layer input brought back to the device at its recompute (the unpack hook
        makes a device copy) that the recompute's own saved tensors do not already count: 0 when the first tensor
        the layer keeps is its input itself (an fp32 stream, a LayerNorm's input), else the copy, held by the
        checkpoint's unpack hook (`args = frame.get_inputs()`) until the recompute returns."""
        if not (self.offload and self.grad_ckpt):
            return 0
        first = self.blocks[0].tensors[:1] if self.blocks else ()
        return 0 if first == (self.ckpt_input_bytes,) else self.ckpt_input_bytes

    def device_layers_saved(self, layers: int | None = None) -> int:
        """What the first `layers` decoder layers keep on the device at the end of the forward: with offloading
        nothing but LLM.int8's inputs of the checkpointed layers, the rest is on the host."""
        n = self.layers if layers is None else layers
        return self.checkpointed_layers(n) * self.ckpt_device_saved if self.offload else self.layers_saved(n)

    @property
    def device_outside_saved(self) -> int:
        """Embedding, head and shared tensors on the device at the end of the forward: with offloading only the
        lm_head's input (the output layer is not offloaded; the fused loss keeps none) and, when a layer is
        checkpointed, the shared rotary cos/sin (keyword arguments its recompute's partial holds) and a frozen
        embedding's output (`embed_leaf_bytes`)."""
        if not self.offload:
            return self.embed_saved + self.head_saved + self.shared_saved
        return self.lm_head_input + (self.shared_saved + self.embed_leaf_bytes if self.grad_ckpt else 0)

    @property
    def head_saved(self) -> int:
        """Kept by the final norm and the lm_head input (head_tensors' sum)."""
        return sum(self.head_tensors)

    @property
    def device_head_saved(self) -> int:
        """The final norm's and the lm_head's saved tensors on the device at the end of the forward: all of them, or
        with offloading only the lm_head's input (the final norm's went to the host)."""
        return self.lm_head_input if self.offload else self.head_saved

    @property
    def lm_head_input(self) -> int:
        """The lm_head's kept input (its weight's gradient needs it; the output layer is not offloaded): 0 when the
        head keeps none."""
        return self.head_tensors[-1] if self.head_tensors and self.lm_head_kept else 0

    @property
    def offloaded_bytes(self) -> int:
        """--offload-activations: the saved tensors that leave the device in forward (one formula for the estimate's
        note and the planner): the layers' (a checkpointed layer's input included), the embedding's, the final
        norm's and, without checkpointing, the shared rotary cos/sin; the lm_head's input stays. Each tensor is
        counted once: autograd packs a tensor per save (a norm's fp32 input twice, a shared input per linear), so the
        pinned host copies can add up to more."""
        if not self.offload:
            return 0
        return self.saved_at_loss - self.device_layers_saved() - self.device_outside_saved

    @property
    def saved_at_loss(self) -> int:
        """Everything kept for backward when the loss backward starts (the usual activation peak)."""
        return self.embed_saved + self.layers_saved() + self.head_saved + self.shared_saved


def virtual_tokens(anatomy: ModelAnatomy) -> int:
    """Prompt tuning: peft prepends this many trained embeddings, so the model runs seq_len + n tokens (and the
    labels get n -100 entries, so the logits and the loss are over seq_len + n positions too)."""
    return anatomy.peft.num_virtual_tokens if anatomy.peft is not None else 0


def sequence_tokens(anatomy: ModelAnatomy, setup: TrainingSetup) -> int:
    """The tokens per sample the language model runs (and its logits and loss cover): --seq-len, prompt tuning's
    virtual tokens, and a vision-language sample's image tokens (the processor's expansion of each image's
    placeholder: llmem.model.vision_inputs)."""
    return _sequence_tokens(anatomy, setup, vision_inputs(setup, anatomy))


def _sequence_tokens(anatomy: ModelAnatomy, setup: TrainingSetup, images: VisionInputs | None) -> int:
    return setup.seq_len + virtual_tokens(anatomy) + (images.visual_tokens if images is not None else 0)


def dims_for(anatomy: ModelAnatomy, setup: TrainingSetup, tp: int) -> Dims:
    return _dims(anatomy, setup, tp, sequence_tokens(anatomy, setup))


def _dims(anatomy: ModelAnatomy, setup: TrainingSetup, tp: int, tokens: int) -> Dims:
    """The dimensions at `tokens` per sample (sequence_tokens)."""
    return Dims(
        b=setup.batch_size, s=tokens, h=anatomy.hidden_size,
        i=-(-anatomy.intermediate_size // tp), qd=anatomy.num_heads // tp * anatomy.head_dim,
        kvd=max(anatomy.num_kv_heads // tp, 1) * anatomy.head_dim, heads=anatomy.num_heads // tp,
        vocab=anatomy.vocab_size, layers=anatomy.num_layers, tp=tp,
        masked=setup.packing and not effective_attention(anatomy, setup).keeps_scores
        and not setup.attention_spec.varlen_packing,
        pos_rows=setup.batch_size if setup.packing else 1,
        seq_shards=tp if setup.sequence_parallel else 1, vocab_shards=tp if setup.loss_parallel else 1,
    )


def has_recipe(anatomy: ModelAnatomy) -> bool:
    """Whether llmem has a recipe written for this family (others use the Llama one, with a note)."""
    return family_of(anatomy.model_type).recipe is not None


def effective_attention(anatomy: ModelAnatomy, setup: TrainingSetup) -> AttentionSpec:
    """HF runs eager attention for models without an SDPA implementation (BLOOM, GPT-Neo, Gemma-2).

    flash (HF flash_attention_2) keeps what PyTorch's flash SDPA kernel keeps (q, k, v, out, logsumexp; GQA native,
    dropout regenerated from the RNG state): the sdpa recipe, also for classes with flash but no SDPA attention
    (Gemma-2). Whether the class has flash attention at all is the support check's (llmem.setup.support)."""
    spec = setup.attention_spec
    return ATTENTIONS[spec.recipe if anatomy.supports_sdpa else ATTENTIONS[spec.without_sdpa].recipe]


def activation_notes(setup: TrainingSetup) -> list[str]:
    """What the estimate and the trace say about the activation options (both engines print them)."""
    notes = []
    if setup.attention_spec.flash_kernel:
        notes.append("--attn flash: the flash-attn package's kernel (HF flash_attention_2) is modelled by PyTorch's "
                     "flash SDPA kernel (the same saved tensors: q, k, v, output, logsumexp)")
    if setup.fused_ce:
        notes.append("--fused-ce: llmem's PyTorch fused linear cross-entropy (Liger-Kernel's algorithm and chunk "
                     "size; an fp32 upcast of each chunk's logits); no [tokens, vocab] logits")
    if setup.offload_activations:
        notes.append("--offload-activations: saved tensors of 1 KiB and more (parameters and their views excepted) "
                     "in pinned host memory from their layer's forward to its backward (torchtune's "
                     "OffloadActivations rules, weight views kept too); the lm_head and the loss stay on the "
                     "device; synchronous copies" + (
                         "; a checkpointed layer's input (the hidden states torch's checkpoint saves) goes to the "
                         "host too and is copied back for its recompute; the rotary cos/sin and masks bound to the "
                         "recompute, and a frozen embedding's output (a leaf its AccumulateGrad node holds), stay "
                         "on the device" if setup.grad_ckpt else ""))
    if setup.ckpt_reentrant:
        notes.append("--ckpt-reentrant: torch's reentrant checkpoint (CheckpointFunction) runs each checkpointed "
                     "layer's forward under no_grad and saves its input, as the non-reentrant one does; LLM.int8's "
                     "MatMul8bitLt keeps no inputs there (its ctx is dropped). The estimate leaves out the few "
                     "[batch, seq, head_dim]-sized tensors the trace sees live longer under it (0.03 % of "
                     "tiny-llama's peak)")
    row = setup.ckpt_offload_spec
    if row.active:
        notes.append(f"--ckpt-offload {row.name}: {row.saves} ({row.function}); its copies and staging buffers "
                     "counted on the compute stream (the side stream, its events and prefetching are not modelled)"
                     + ("; more than 512 MiB free at the second step's first offload assumed for the second buffer "
                        "(else Unsloth frees it: --ckpt-offload unsloth-single); FastLanguageModel runs torch's "
                        "reentrant checkpoint instead below max_seq_length 512 (--ckpt-reentrant)"
                        if row.staging > 1 else "")
                     + ". The rest of Unsloth's stack (fast LoRA, fused cross-entropy, RoPE, RMSNorm kernels) is "
                     "not modelled: HF's modules stand in")
    if setup.liger != "none":
        notes.append(f"--liger {setup.liger}: Liger-Kernel's autograd Functions over HF's modules, in PyTorch with "
                     "Liger's saved tensors (RMSNorm: its input and fp32 RSTD; SwiGLU: gate and up, recomputed "
                     "in backward, whose gradients overwrite them; RoPE: q and k rotated in place, the same saved "
                     "tensors as HF's)" + ("; auto: rms_norm, swiglu and rope where llmem models the family's "
                                            "patch, HF's modules elsewhere" if setup.liger == AUTO else ""))
    if setup.float8 != "none":
        notes.append(f"--float8 {setup.float8}: torchao's Float8Linear in eager mode on every decoder linear (not "
                     "the lm_head): the bf16 input kept as nn.Linear keeps it, each operand cast anew for each "
                     "matmul (an fp32 scaled copy and its clamp before the float8 tensor)" + (
                         "; FSDP2 gathers the converted weights in float8" if setup.float8_all_gather else "")
                     + "; torch.compile, which fuses the casts, is not modelled")
    if setup.compile:
        notes.append("--compile: each decoder layer's forward compiled (inside its checkpoint, torchtune's order), "
                     "what the forward saves chosen by inductor's own decompositions and min-cut partitioner, run "
                     "on fake tensors at this micro-batch's shape; inductor's generated kernels are not: the "
                     "partitioned graphs run op by op, so the saved tensors are exact and a layer's transients an "
                     "upper bound (fused pointwise chains make none); the estimate reads a compiled layer as one block, "
                     "its backward one transient (peak reserved can run a few per cent over the trace's for wide "
                     "layers); the loss is not compiled")
    if setup.logits_dtype != "fp32":
        notes.append(f"--logits-dtype {setup.logits_dtype}: cross-entropy on the lm_head's output without "
                     "transformers' fp32 upcast (its log-softmax in that dtype; under autocast nll_loss keeps an fp32 cast of "
                     "it)")
    if setup.packing:
        notes.append("--packing: position ids restart per packed sample; " + setup.attention_spec.packing_note)
    if setup.grad_ckpt and setup.ckpt_every > 1:
        notes.append(f"checkpointing decoder layers with index % {setup.ckpt_every} == 0 (HF every_n_layers)")
    if AC_POLICIES[setup.ac_policy].selective:
        notes.append(f"--ac-policy {setup.ac_policy}: {AC_POLICIES[setup.ac_policy].saves} (torch's "
                     "create_selective_checkpoint_contexts); the recompute skips the saved ops")
    if setup.sequence_parallel:
        notes.append("--sequence-parallel: torchtitan's plan on HF's model (SequenceParallel norms, PrepareModuleInput "
                     "all-gathers before attention / MLP, reduce-scatters after); the residual stream, the norms and "
                     "checkpointed layer inputs sequence-sharded, the linears keep the gathered [tokens, hidden] "
                     "input; the stream stays a DTensor (use_local_output=False) as HF reads its sequence length")
    if setup.loss_parallel:
        notes.append("--loss-parallel: HF's cross-entropy on [tokens, vocab/tp] logits under torch's "
                     "loss_parallel() (its log-softmax and fused backward on the shard; no full-vocab gather)")
    if setup.peft and setup.mixed and setup.adapter_dtype == "base":
        notes.append(f"--adapter-dtype base under {setup.precision}: peft builds the adapters on the fp32 model "
                     "(the masters *-mixed trains) before the frozen base is cast, so they are fp32 as with fp32; "
                     f"for adapters in the base's dtype use --precision {setup.precision.removesuffix('-mixed')} "
                     "--adapter-dtype base")
    return notes


def embedding_leaf_bytes(anatomy: ModelAnatomy, setup: TrainingSetup, regime: Regime, tokens: int) -> int:
    """The token embedding's output when the embedding is frozen (made a leaf that requires grad by
    transformers' enable_input_require_grads under checkpointing): [batch, seq_len, hidden] in the stream's dtype
    (prompt tuning's virtual tokens are concatenated after it). 0 when the embedding trains, or peft's LoRA on it
    (its output has a graph already). `tokens`: the language model's per sample (sequence_tokens)."""
    embeddings = [p for p in anatomy.outside_layer_params if is_embedding(p) and p.shape
                  and p.shape[0] == anatomy.vocab_size]
    if any(p.trainable for p in embeddings) or any(p.trainable and is_embedding_adapter(p.name)
                                                   for p in anatomy.outside_layer_params):
        return 0
    embedded = tokens - virtual_tokens(anatomy)    # a VLM's image tokens are embedded too
    return setup.batch_size * embedded * anatomy.hidden_size * regime.res


def activation_profile(r: ResolvedSetup) -> ActivationProfile:
    anatomy, setup, regime = r.anatomy, r.setup, r.regime
    images = vision_inputs(setup, anatomy)    # a vision-language step's images, sized once for the whole profile
    d = _dims(anatomy, setup, r.layout.tp, _sequence_tokens(anatomy, setup, images))
    attn = effective_attention(anatomy, setup)
    selective = AC_POLICIES[setup.ac_policy].selective
    learned = learned_recipe(r)    # activations learned from the real code (no hand recipe for this set-up)
    recipe = learned or recipe_for(anatomy)(anatomy, d, regime, attn)
    if r.layout.cp > 1:          # torch's ring attention (llmem.memory.activations.context_parallel)
        recipe = with_ring_attention(recipe, d, regime, r.layout.cp)
    kernels = applied_kernels(setup.liger, anatomy.model_type)
    if kernels:                  # Liger-Kernel's RMSNorm / SwiGLU (llmem.memory.activations.liger)
        recipe = with_liger(recipe, kernels, d, regime)
    if setup.float8 != "none":   # torchao's Float8Linear casts (llmem.memory.activations.float8)
        recipe = with_float8(recipe, anatomy, d, FLOAT8_RECIPES[setup.float8], weight_cast=not setup.float8_all_gather)
    behind_fp32 = fp32_behind_quant(setup.quant_base, regime)
    if behind_fp32:
        recipe = with_fp32_mlp(recipe, d)
    fused = fused_ce_for(anatomy, setup, r.method.shards_model_states, d, regime) if setup.fused_ce else None
    if fused is not None:   # the lm_head's input (the recipe's last head tensor) is not kept: the loss keeps grads
        last = len(recipe.head) - 1
        recipe = LayerRecipe(recipe.blocks, recipe.embed, recipe.head[:last], recipe.shared,
                             tuple(tag for tag in recipe.head_for_weights if tag[0] < last), recipe.head_back)
    exact = anatomy.peft is None or anatomy.peft.exact
    adapted = adapter_regime(setup.quant_base, regime)    # what peft's bitsandbytes LoRA layers cast
    # fp32 adapters on a pure low-precision base (peft's bitsandbytes LoRA layers cast alike outside autocast)
    upcast = adapters_upcast(anatomy, setup, adapted) or quant_adapters_upcast(anatomy, setup, adapted)
    downcast = quant_adapters_downcast(anatomy, setup, adapted)     # TRL's bf16 adapters over an fp32 input
    if learned is None and any(not p.trainable for p in anatomy.params):   # learned: as peft runs already
        recipe = with_trainability(anatomy, recipe, adapters_read_input(anatomy, adapted, upcast or bool(downcast)),
                                   frozen_base=not exact, quant_base="none" if behind_fp32 else setup.quant_base)
    if learned is None and exact and any(".lora_A." in p.name or ".ia3_l." in p.name for p in anatomy.params):
        recipe = with_adapters(anatomy, recipe, d, adapted, behind_fp32, upcast, downcast)
    int8_kept: Sizes = ()
    if setup.quant_spec.quantised and quant_layout(setup.quant_base).keeps_inputs:
        int8_kept = int8_inputs_kept(anatomy, recipe.blocks, d.t, regime, behind_fp32)
        if behind_fp32 and (not setup.grad_ckpt or setup.ckpt_every > 1):   # fp32 inputs only LLM.int8 keeps
            recipe = with_int8_inputs(anatomy, recipe, d.t, regime)
        if setup.ckpt_reentrant:   # CheckpointFunction runs the layer under no_grad: MatMul8bitLt keeps no ctx
            int8_kept = ()
    selective = selective_layer(anatomy, recipe.blocks, d, regime, attn, learned_selective(r),
                                learning_failure(r) or "") if selective else None
    loss = loss_logits(setup, d, regime)
    embed = recipe.embed if learned is not None else recipe.embed + _embedding_adapter_side(r, d, regime)
    cross = learned_cross_blocks(r)
    return ActivationProfile(
        selective=selective, loss=loss,
        embed_leaf_bytes=embedding_leaf_bytes(anatomy, setup, regime, d.s) if setup.grad_ckpt else 0,
        # the lm_head keeps its input for its own weight's gradient, or LoRA's lora_A reads it (not under autocast
        # or with fp32 adapters on a bf16 base: lora_A keeps its own copy, llmem.estimator.schedule.head)
        lm_head_kept=fused is None and any(
            p.trainable and is_lm_head(p) and (not is_adapter_param(p.name) or adapters_read_input(
                anatomy, adapted, upcast or bool(downcast)))
            for p in anatomy.outside_layer_params),
        first_layer_skip=first_layer_skip(anatomy, recipe.blocks),
        per_layer_saved=sum(b.saved for b in recipe.blocks),
        checkpoint_saved=d.ts * d.h * regime.res + sum(int8_kept)
        + (selective.kept_bytes(recipe.blocks) if selective is not None else 0),
        int8_kept=int8_kept,
        embed_saved=sum(embed), shared_saved=sum(recipe.shared),
        embed_tensors=embed, head_tensors=recipe.head, shared_tensors=recipe.shared, head_back=recipe.head_back,
        loss_peak=(fused.grad_input_bytes + fused.grad_weight_bytes if fused is not None else
                   loss.chunked.backward_peak_bytes if loss.chunked is not None else
                   loss_peak_bytes(d, loss.element_bytes, loss.nll_cast) + (d.t * d.vocab * regime.mm if config_value(
                       anatomy, "final_logit_softcapping", default=None) else 0)),
        blocks=recipe.blocks,
        grad_ckpt=setup.grad_ckpt, layers=d.layers, ckpt_every=setup.ckpt_every, fused_ce=fused,
        offload=setup.offload_activations,
        mask_bytes=packed_mask_bytes(d) + _vision_mask_bytes(anatomy, setup, images),
        compiled=setup.compile,
        vision=VisionStep(_vision_batch_bytes(anatomy, setup, images), vision_modules(anatomy.model_type),
                          learned_vision(r), vision_root(anatomy.model_type), tower_units(anatomy),
                          vision_spec(anatomy.model_type).unit_in_block,
                          bool(vision_spec(anatomy.model_type).cross_attention_layers))
        if setup.images_per_sample else None,
        # (the cross-attention layers' own blocks are learned: without them, every layer the fallback recipe's)
        kinds=LayerKinds(cross, cross_attention_layers(anatomy), graphless_layers(anatomy, setup)) if cross else
        LayerKinds(),
    )


def _embedding_adapter_side(r: ResolvedSetup, d: Dims, regime: Regime) -> Sizes:
    """peft's LoRA on the input embedding: its matmul's operands, kept until the embedding's backward (a learned
    recipe's embedding side has them already)."""
    return embedding_adapter_kept(embedding_adapters(r.anatomy, r.setup, regime, d.t, r.layout.shards_model_states))


def graphless_layers(anatomy: ModelAnatomy, setup: TrainingSetup) -> int:
    """The decoder layers before the first cross-attention layer (Llama 3.2 Vision's) when nothing below it trains: a
    frozen token embedding and frozen layers, without checkpointing (whose enable_input_require_grads makes the
    embedding's output require grad). Autograd records nothing there (MllamaTextModel's stream needs no gradient
    until a cross-attention layer reads the trained image features), so they keep nothing. 0 otherwise."""
    crossing = cross_attention_layers(anatomy)
    if not crossing or setup.grad_ckpt:
        return 0
    first = min(crossing)
    spec = vision_spec(anatomy.model_type)
    below = (p for p in anatomy.params if p.trainable and part_of(spec, p.name) == LANGUAGE and (
        p.layer_index is not None and p.layer_index < first or p.layer_index is None and is_embedding(p)))
    return 0 if any(below) else first



def vision_mask_bytes(anatomy: ModelAnatomy, setup: TrainingSetup) -> int:
    """A vision-language model's masks built once per forward (Gemma 3's over token_type_ids), 0 for a text step."""
    return _vision_mask_bytes(anatomy, setup, vision_inputs(setup, anatomy))


def _vision_mask_bytes(anatomy: ModelAnatomy, setup: TrainingSetup, images: VisionInputs | None) -> int:
    return images.mask_bytes(setup.batch_size, vision_spec(anatomy.model_type)) if images is not None else 0


def vision_batch_bytes(anatomy: ModelAnatomy, setup: TrainingSetup) -> tuple[int, ...]:
    """A vision-language micro-batch's tensors on the device (llmem.model.vision_inputs), () for a text step (its
    token ids are a few bytes a token, not laid out)."""
    return _vision_batch_bytes(anatomy, setup, vision_inputs(setup, anatomy))


def _vision_batch_bytes(anatomy: ModelAnatomy, setup: TrainingSetup, images: VisionInputs | None) -> tuple[int, ...]:
    if images is None:
        return ()
    return images.batch_bytes(setup.batch_size, vision_spec(anatomy.model_type))

