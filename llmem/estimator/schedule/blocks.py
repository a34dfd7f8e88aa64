"""An activation block's tensors in the step schedule: its forward's kept tensors with peft's temporaries among
them (`block_plan`), a quantised base's dequantisation transients (bitsandbytes, torchao: llmem.memory.quant) and a
block's backward transient.

Known Limitations: a block's backward is one transient (the recipe's, llmem.memory.activations.blocks), laid out
in pieces of at most [t, h] only under --sequence-parallel; HF's RMSNorm's is its own events, op by op
(Block.back_events), and so is the final norm's (final_norm_backward).
"""

from __future__ import annotations

from llmem.estimator.events import Schedule
from llmem.estimator.schedule.facts import StepFacts
from llmem.estimator.schedule.state import StepState
from llmem.memory.activations.blocks import Block
from llmem.memory.activations.quantised import quant_input_bytes
from llmem.memory.quant import allocated, quant_layout
from llmem.model.anatomy import ParamInfo

BlockOps = list[tuple[int, int, int]]


def block_plan(b: Block) -> BlockOps:
    """A block's forward as (op, bytes, temporary index): op 0 keeps a tensor, 1 allocates temporary i, 2 frees it.
    Temporaries (peft's adapters) sit at fractional positions between the kept tensors."""
    ops: BlockOps = []
    live: list[tuple[int, float]] = []
    positions = sorted({*range(len(b.tensors) + 1), *(a for _, a, _ in b.temps), *(f for _, _, f in b.temps)})
    for pos in positions:
        for k, (n, a, f) in enumerate(b.temps):
            if a == pos and f == pos:
                ops.append((1, n, k))
                live.append((k, f))
        ops += [(2, 0, k) for k, f in live if f <= pos]
        live = [x for x in live if x[1] > pos]
        for k, (n, a, f) in enumerate(b.temps):
            if a == pos and f != pos:
                ops.append((1, n, k))
                live.append((k, f))
        if pos == int(pos) and pos < len(b.tensors):
            ops.append((0, b.tensors[int(pos)], -1))
    return ops + [(2, 0, k) for k, _ in live]


class BlockEvents:
    """A block's forward tensors, dequantisation and backward transient in `sch`."""

    def __init__(self, facts: StepFacts, sch: Schedule, state: StepState) -> None:
        self.f, self.sch, self.live = facts, sch, state
        self.plans: dict[int, BlockOps] = {}      # block_plan per block (by identity)

    def forward(self, b: Block, given: dict[int, int] | None = None) -> list[int]:
        """The block's kept tensors, with its forward temporaries allocated and freed among them. `given`: kept
        tensors (by index) that exist already (selective checkpointing's stored outputs, handed back to the
        recompute), with their keys."""
        alloc = self.sch.alloc
        if not given:        # (the event log plays the block in one call)
            if not b.temps:
                return self.sch.alloc_many(b.tensors, "activations")
            return self.sch.play_block(self.plan(b), "activations")
        if not b.temps:
            return [given[k] if k in given else alloc(n, "activations") for k, n in enumerate(b.tensors)]
        plan = self.plan(b)
        keys: list[int] = []
        temps: dict[int, int] = {}
        for op, n, k in plan:
            if op == 0:
                keys.append(given[len(keys)] if len(keys) in given else alloc(n, "activations"))
            elif op == 1:
                temps[k] = alloc(n, "activations")
            else:
                self.sch.free(temps.pop(k))
        return keys

    def plan(self, b: Block) -> BlockOps:
        plan = self.plans.get(id(b))
        if plan is None:
            plan = self.plans[id(b)] = block_plan(b)
        return plan

    def play(self, events) -> list[int]:
        """A quantised linear's transient events (llmem.memory.quant); returns the keys they leave allocated."""
        return list(self.play_tagged(events, {}).values())

    def play_tagged(self, events, keys: dict[int, int]) -> dict[int, int]:
        """Events after others that left `keys` (tag -> key) allocated; what is left, by tag."""
        for sign, tag, n in events:
            if sign > 0:
                keys[tag] = self.sch.alloc(n, "activations")
            else:
                self.sch.free(keys.pop(tag))
        return keys

    def dequantise(self, params: list[ParamInfo], backward: bool, block: Block | None = None, tokens: int = 0,
                   adapters: bool = True) -> None:
        """Forward: each quantised linear's transients, one after the other, then (bitsandbytes nf4) its output in
        the compute dtype, its cast back to the input dtype (Linear4bit returns the input's dtype) and, in peft's
        4-bit LoRA layer, the clone of it that the adapter's output is added into (torchao's LinearNF4 returns
        F.linear's output itself: the recipe's tensor). Backward: the largest one's, what it leaves live while the
        block's input gradients are made (the caller frees them). `tokens`: the rows x tokens the linears run on
        (0: the step's); `adapters` False: peft's disable_adapter() (the base layer alone, no clone)."""
        quant_tmp = self.f.quant_tmp
        if not quant_tmp:          # an unquantised base: nothing to dequantise (the common case, asked per block)
            return
        if backward:
            sets = [quant_tmp[p.name].backward for p in params if p.name in quant_tmp]
            if sets:
                self.live.quant_live.extend(self.play(max(sets, key=lambda e: sum(allocated(e)))))
            return
        for p in params:
            if p.name not in quant_tmp:
                continue
            keys = self.play(quant_tmp[p.name].forward)
            if block is None or not quant_layout(self.f.setup.quant_base).casts_output:
                self.sch.free_all(keys)
                continue
            self.cast_output(p, block, keys, tokens or self.f.t, adapters)

    def cast_output(self, p: ParamInfo, block: Block, keys: list[int], tokens: int, adapters: bool = True) -> None:
        """The output of `p`'s quantised linear as bitsandbytes' Linear4bit returns it (QuantLayout.casts_output: its
        dequantised weight `keys` die with gemm_4bit, the output is cast to its input's dtype, peft clones it)."""
        sch, alloc, mm = self.sch, self.sch.alloc, self.f.quant_args.dtype_bytes
        rows = tokens * p.out_features                   # elements of the linear's output
        out = alloc(rows * mm, "activations")
        sch.free_all(keys)                               # the dequantised weight dies with gemm_4bit
        in_bytes = quant_input_bytes(block, self.f.regime, self.f.fp32_behind_quant)
        if in_bytes != mm:
            cast = alloc(rows * in_bytes, "activations")   # .to(inp_dtype)
            sch.free(out)
            out = cast
        if adapters and p.name in self.f.params.adapted:
            clone = alloc(rows * in_bytes, "activations")  # result.clone()
            sch.free(out)
            total = alloc(rows * in_bytes, "activations")  # result + lora_B(lora_A(x)) * scaling
            sch.free(clone)
            out = total
        sch.free(out)                                    # the recipe's tensors hold the output kept

    def final_norm_backward(self, grad_in: int) -> list[int]:
        """The final norm's backward (ActivationProfile.head_back, where known op by op) on the gradient of its output
        `grad_in`, which dies once its first node has read it; the keys it leaves (the caller frees them)."""
        back = self.f.act.head_back
        if not back:
            return [grad_in]
        keys = self.play_tagged(back[:1], {})
        self.sch.free(grad_in)
        return list(self.play_tagged(back[1:], keys).values())

    def backward_transient(self, b: Block) -> list[int]:
        """A block's backward transient. Under --sequence-parallel it is made of full-sequence [t, h] tensors (each
        linear's input gradient of the all-gathered input, and the norm's gradient before its reduce-scatter and the
        rearranged copy: DTensor's redistribute Replicate/Partial -> Shard(1)), each its own allocation, so it is laid
        out as pieces of at most [t, h] in the compute dtype (allocated together: the same bytes at once)."""
        alloc, n = self.sch.alloc, b.transient
        before, after = b.back_casts        # Float8Linear's casts around it (llmem.memory.activations.float8)
        left = self.play_tagged(before, {})
        if b.back_events:         # known op by op (HF's RMSNorm): what they leave is freed with the block
            own = list(self.play_tagged(b.back_events, {}).values())
            return own + list(self.play_tagged(after, left).values())
        piece = self.f.t * self.f.hidden_size * self.f.regime.mm if self.f.setup.sequence_parallel else n
        if piece <= 0 or n <= piece:
            keys = [alloc(n, "activations")]
        else:
            keys = [alloc(min(piece, n - k), "activations") for k in range(0, n, piece)]
        return keys + list(self.play_tagged(after, left).values())
