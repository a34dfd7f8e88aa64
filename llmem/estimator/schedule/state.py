"""What is live during a step schedule: the keys (llmem.estimator.events.Schedule's) of the tensors allocated and
not yet freed, by role, so that each event knows what it frees. A key is -1 for a tensor never laid out (below the
schedule's min_bytes, or not made).

One `StepState` per schedule, in sections: FSDP2's units and collectives, the gradients, what one forward leaves
for its backward (`ForwardLive`: a pipeline stage keeps one per micro-batch in flight), the optimizer's states.
`Schedule.free_all` clears the list it is given: the lists here are emptied in place as their tensors die.

Known Limitations: the keys say nothing of a tensor's size or role on their own (the Schedule holds those); a key
left in a list after its tensor was freed elsewhere would be freed twice (the Schedule raises KeyError).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmem.model.anatomy import ParamInfo

# a decoder layer's index, None: the root unit (embeddings, final norm, lm_head), "embed" / "head": under
# --shard-embeddings the input embedding's and the lm_head's units (llmem.estimator.schedule.facts own_units)
UnitKey = int | str | None


@dataclass
class UnitsLive:
    """FSDP2's gathered units and its collectives' buffers (llmem.estimator.schedule.units)."""
    gathered: dict[UnitKey, list[int]] = field(default_factory=dict)          # unsharded parameters per unit
    gathered_by: dict[UnitKey, list[list[int]]] = field(default_factory=dict)  # ... per FSDP2 group (--ep)
    ag_forward: dict[int, list[int]] = field(default_factory=dict)    # --ep: prefetched forward all-gathers
    ag_out: dict[UnitKey, list[int]] = field(default_factory=dict)    # prefetched all-gather outputs (backward)
    last_forward_ag: list[int] = field(default_factory=list)          # the forward's latest all-gather output
    post_forward_shards: dict[UnitKey, list[int]] = field(default_factory=dict)   # --reshard-after-forward N
    pending_rs: list[int] = field(default_factory=list)   # the latest reduce-scatter input (freed at the next)
    rs_outputs: list[int] = field(default_factory=list)   # sharded gradients until the optimizer step


@dataclass
class GradsLive:
    """The gradients (llmem.estimator.schedule.gradients)."""
    grads: dict[str, int] = field(default_factory=dict)   # param -> its final gradient (non-FSDP) until the step
    root_unsharded: dict[str, int] = field(default_factory=dict)   # FSDP2: the root's unsharded gradients
    layer_unsharded: list[int] = field(default_factory=list)       # FSDP2: this layer's unsharded gradients
    unsharded_of: dict[str, int] = field(default_factory=dict)     # --ep: ... by parameter name
    pending_steps: list[ParamInfo] = field(default_factory=list)   # --optimizer-in-backward: hooks to run


@dataclass
class HeadLoraLive:
    """LoRA on the lm_head: what its forward keeps for lora_A (its input, where it is not the lm_head's own: peft's
    fp32 copy, autocast's cast of it or the dropout's output), the dropout's mask, and lora_A's output."""
    input: int = -1
    mask: int = -1
    out: int = -1


@dataclass
class ChunkedLive:
    """torchtune's chunked output (llmem.estimator.schedule.chunked_head): per chunk, the lm_head's saved input copy
    (batch > 1), its logits until the recipe drops them, the loss's kept log-softmax, then its logits gradient."""
    inputs: list[int] = field(default_factory=list)
    logits: list[int] = field(default_factory=list)
    log_softmax: list[int] = field(default_factory=list)
    grads: list[int] = field(default_factory=list)
    labels: int = -1          # the recipe's shifted labels, which nll_loss keeps (chunks of them) for backward
    saved: list[list[int]] = field(default_factory=list)   # compiled: each chunk's row maxima and log-sum-exp


@dataclass
class ForwardLive:
    """What one forward leaves for its backward (llmem.estimator.schedule.layers and .head)."""
    cache: list[int] = field(default_factory=list)         # autocast's cached casts of trained weights
    bias_cache: list[int] = field(default_factory=list)    # ... of trained biases, until autocast exits
    copies_by_layer: dict[UnitKey, list[list[int]]] = field(default_factory=dict)   # weight copies kept, per block
    embed_keys: list[int] = field(default_factory=list)
    shared_keys: list[int] = field(default_factory=list)   # rotary cos/sin, shared by the layers
    layer_keys: dict[int, list[list[int]]] = field(default_factory=dict)   # each layer's kept tensors, per block
    ckpt_keys: dict[int, int] = field(default_factory=dict)                 # a checkpointed layer's input
    sac_keys: dict[int, dict[tuple[int, int], int]] = field(default_factory=dict)   # --ac-policy op: stored tensors
    sac_extra: dict[int, list[tuple[int, int, bool]]] = field(default_factory=dict)  # ... other stored outputs
    passed: int = -1          # offloaded checkpointing: the last checkpointed layer's output, the next one's input
    int8_keys: dict[int, list[int]] = field(default_factory=dict)   # LLM.int8's inputs a checkpointed layer keeps
    head_keys: list[int] = field(default_factory=list)
    head_offloaded: list[int] = field(default_factory=list)   # sizes of the head's tensors on the host
    head_copy: list[int] = field(default_factory=list)        # autocast's copies of the head's weights
    head_lora: HeadLoraLive = field(default_factory=HeadLoraLive)   # LoRA on the lm_head's kept tensors
    fused_grads: tuple[int, int] = (-1, -1)                   # --fused-ce: grad_input and grad_weight kept
    logits: int = -1
    log_softmax: int = -1
    nll_cast: int = -1                                        # --logits-dtype model under autocast: nll_loss's fp32 input
    chunked: ChunkedLive = field(default_factory=ChunkedLive)   # --output-chunks: torchtune's chunked output
    output: int = -1          # a pipeline stage's output (llmem.estimator.pipeline)


@dataclass
class StepState:
    """The step's live tensors, by section."""
    units: UnitsLive = field(default_factory=UnitsLive)
    grads: GradsLive = field(default_factory=GradsLive)
    forward: ForwardLive = field(default_factory=ForwardLive)
    states: list[int] = field(default_factory=list)        # the optimizer's states
    quant_live: list[int] = field(default_factory=list)    # a quantised linear's backward transients
    workspace: int = -1                                     # cuBLAS's workspace, made at the first matmul
    iteration: int = 0                                      # the step's iteration (0: the first)
    staging: list[int] = field(default_factory=list)        # --ckpt-offload: Unsloth's device staging buffers
