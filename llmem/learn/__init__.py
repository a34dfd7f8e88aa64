"""Activations learned from the real code, a floor between the estimator and the runtime: the general path for
set-ups without a hand recipe (a model family with none written, a peft type without an exact model).

A copy of the model with LEARN_DEPTH decoder layers (its own config otherwise) runs one real training step on fake
tensors - the set-up's peft adapters, dtype regime, attention implementation, packing - through the trace's own
machinery (llmem.runtime.step's prepared_step, the ledger, the module tracker), at the batch x sequence POINTS.
Every allocation is read back with its module, phase and lifetime, and sorted by who releases it:

- decoder layer READ_LAYER (the last) keeps what is freed in its backward, and makes forward temporaries freed in its
  forward; what the layer before made and it releases (the residual stream) is its input, placed at its start;
- the head keeps what is freed in the final norm's and lm_head's backward (the loss itself is the schedule's);
- what the embedding side keeps until backward, less the first layer's inputs, is the embedding's (per sample) or
  shared (rotary cos/sin: no batch dimension).

The layer is cut into blocks at the first op of each module owning parameters (a peft tuner layer with its adapters
is one) and of each parameterless leaf module (an activation, a dropout), so the schedule gives each block its
parameters' autocast copies and gradients and its own backward transient; a temporary live across a cut is freed at
its block's end and made again at the next one's start. Each block's backward transient is the largest excess, over
its window of the backward, of what the real step holds (the layer's kept tensors still live, what backward made and
has not freed, the layer's gradients) over what the schedule holds there (the kept tensors of this and the earlier
blocks, the gradients of this and the later ones): with it the schedule's peak in that window is the real one.
Autocast's copies of nn.Linear weights are the schedule's (left out here); other weight-sized tensors (OFT's
rotations, a LayerNorm weight's fp32 copy) are learned as the layer's tensors.

Every size is fitted exactly (rational arithmetic) in 1, b, s, b*s, b*s^2 from the POINTS (batch >= 2), at which the
step must allocate alike, one for one (else the learning is refused with the reason). The result is cached per key
(llmem.memory.activations.learned) in memory and on disk.

The modules: shallow_copy (the entry point: learned_activations), one_point (one run of the copy), fit (the exact
fit), layer_blocks (reading the layer), selective_read (what --ac-policy op keeps of it), points (what they share).
"""
