"""Optimizers on the set-up floor: one row per `--optimizer`, the only place an optimizer's memory is written.

A row says what the optimizer keeps (`states`: the device tensors it creates per parameter, in creation order;
`shared_state_bytes`: tensors shared by all parameters; `outside_allocator_bytes`: memory PyTorch's counters never
see), what one step allocates and frees (`step_events`, replayed by the estimator's schedule), how the step walks
the parameters (`step_scope`), where it runs (`plain_tensors_only`), what the result says about it (`notes`), and
the flags the planner and the exports read. The trace and measure build the optimizer itself from
`llmem.runtime.optimizers.BUILDERS`, one entry per row (tests/estimator/test_optimizers.py checks both lists agree).

Shapes are rank-local; `pb` is the bytes per element of the parameter (and of its gradient). Step counters that
live on the host (torch's non-fused, non-capturable optimizers; Adafactor always; bitsandbytes' python int;
torchao's CPU float tensor) are not device memory.

Adding an optimizer: a row here, a builder entry in llmem/runtime/optimizers.py, a CI row in
llmem/validate/matrices.py and a hand-worked test of its state and step bytes (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod

from llmem.errors import LlmemError
from llmem.setup.precision import F32

Shape = tuple[int, ...]
Event = tuple[int, int, int]        # (+1 alloc / -1 free, tag, bytes)

# bitsandbytes/optim/optimizer.py (0.50)
BNB_BLOCK_SIZE = 256            # Optimizer2State.init_state: blocksize = 256 for the blockwise 8-bit states
BNB_MIN_8BIT_SIZE = 4096        # AdamW8bit(min_8bit_size=4096): smaller parameters keep 32-bit states
BNB_PAGED_MIN_NUMEL = 100_000   # get_state_buffer: paged only when p.numel() >= 1e5
BNB_QMAP_ENTRIES = 256          # F.create_dynamic_map(signed=...): 2**8 fp32 values

# OptimizerSpec.step_scope: how the estimator's schedule replays the step temporaries
PER_GROUP = "per_group"         # one foreach call per parameter group (step_events over the group)
ALL_PARAMETERS = "all"          # a for-loop over every parameter (step_events over all, in order)
NO_TEMPORARIES = "none"         # fused kernels / in-place updates

# OptimizerSpec.redistribute: when a vocab-parallel embedding's replicated gradient (DTensor under TP) is
# redistributed to its shards: where the step first combines it with a sharded tensor
BEFORE_STEP = "before"
AFTER_TEMPORARIES = "after"
AT_FIRST_FREE = "first_free"


def bnb_blocks(numel: int) -> int:
    """Blocks of bitsandbytes' blockwise quantisation: (n // blocksize) + bool(n % blocksize)."""
    return numel // BNB_BLOCK_SIZE + bool(numel % BNB_BLOCK_SIZE)


def _no_states(shape: Shape, pb: int) -> list[int]:
    return []


def _no_events(shapes: list[Shape], pb: int, shards: int = 1) -> list[Event]:
    return []


def _no_shared(shapes: list[Shape], per_parameter: bool) -> int:
    return 0


def _nothing_outside(shape: Shape) -> int:
    return 0


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    name: str
    summary: str                                            # --help
    states: Callable[[Shape, int], list[int]]               # device state tensors of one parameter, in order
    # temporaries of one step over one group: (shapes, pb, shards), shards > 1 for FSDP2's DTensor shards of dim 0
    step_events: Callable[..., list[Event]]
    step_scope: str = PER_GROUP
    redistribute: str = BEFORE_STEP
    shared_state_bytes: Callable[[list[Shape], bool], int] = _no_shared
    outside_allocator_bytes: Callable[[Shape], int] = _nothing_outside
    host_step_counters: bool = True      # step counts are host scalars (a fused kernel keeps them on the device)
    plain_tensors_only: str = ""         # why it cannot run on DTensor shards ({name}, {method}); "" if it can
    adam: bool = False                   # an Adam(W): the paper models it, the exports carry it
    low_bit: bool = False                # states quantised to 8 bits or fewer (bitsandbytes, torchao)
    paged: bool = False                  # bitsandbytes' paged (cudaMallocManaged) states
    estimate_notes: tuple[str, ...] = ()
    step_notes: tuple[str, ...] = ()     # trace and measure (the real step)
    sharded_notes: tuple[str, ...] = ()  # the estimate's, on FSDP2's shards
    tp_refusal: str = ""                 # why it is not modelled with tensor parallelism ({name}, {method}); "": it is
    # a composite (e.g. Muon for the hidden layers' matrices, AdamW for the rest): each parameter is stepped by
    # one part, `part_of(param)` (a ParamInfo) giving its index; the parts step one after the other
    parts: tuple[OptimizerSpec, ...] = ()
    part_of: Callable[[object], int] | None = None
    # which parameter of the group (its index among step_events' shapes) an event's tag is of; None where the
    # events do not say (a deep model's schedule is then built whole: llmem.estimator.deepen)
    event_param: Callable[[int], int] | None = None

    def part(self, param) -> OptimizerSpec:
        """The row that steps `param` (a ParamInfo): itself, or the composite's part."""
        return self.parts[self.part_of(param)] if self.parts else self

    def split(self, params: list) -> list[tuple[OptimizerSpec, list]]:
        """`params` by the part that steps them, in stepping order (non-composite: all of them, itself)."""
        if not self.parts:
            return [(self, list(params))]
        out = [(part, [p for p in params if self.part_of(p) == i]) for i, part in enumerate(self.parts)]
        return [(part, ps) for part, ps in out if ps]

    def notes(self, engine: str, in_backward: bool = False) -> list[str]:
        """What a result says about the optimizer; engine "estimate", or "trace" / "measure" (the real step);
        `in_backward`: stepped in backward (--optimizer-in-backward)."""
        notes = list(self.estimate_notes if engine == "estimate" else self.step_notes)
        return notes + [IN_BACKWARD_NOTE] if in_backward else notes


# ------------------------------------------------------------------------------------------------ torch.optim

def _adam_states(shape: Shape, pb: int) -> list[int]:
    n = prod(shape)
    return [n * pb, n * pb]                            # exp_avg, exp_avg_sq


def _one_state(shape: Shape, pb: int) -> list[int]:
    return [prod(shape) * pb]                          # momentum_buffer / exp_avg


def _foreach_copy_events(shapes: list[Shape], pb: int, shards: int = 1) -> list[Event]:
    """One copy of every state of the group, then freed: foreach AdamW's torch._foreach_sqrt(exp_avg_sqs),
    llmem's Lion's torch._foreach_mul(exp_avgs, beta1)."""
    ev: list[Event] = [(1, i, prod(s) * pb) for i, s in enumerate(shapes)]
    return ev + [(-1, i, prod(s) * pb) for i, s in enumerate(shapes)]


def _tag_is_param(tag: int) -> int:
    """_foreach_copy_events' tags: the parameter's index."""
    return tag


def _two_tags_a_param(tag: int) -> int:
    """_forloop_adamw_events' tags: two per parameter."""
    return tag // 2


def _forloop_adamw_events(shapes: list[Shape], pb: int, shards: int = 1) -> list[Event]:
    """_single_tensor_adamw: exp_avg_sq.sqrt() / bias_correction2_sqrt: two temporaries of each parameter."""
    ev: list[Event] = []
    for i, s in enumerate(shapes):
        ev += [(1, 2 * i, prod(s) * pb), (1, 2 * i + 1, prod(s) * pb),
               (-1, 2 * i, prod(s) * pb), (-1, 2 * i + 1, prod(s) * pb)]
    return ev


def _adafactor_states(shape: Shape, pb: int) -> list[int]:
    """torch.optim.Adafactor._init_group: >= 2-D: row_var [..., m, 1] and col_var [..., 1, n] (grad dtype); 1-D: a
    full variance."""
    if len(shape) >= 2:
        return [prod(shape[:-1]) * pb, prod(shape[:-2]) * shape[-1] * pb]
    return [prod(shape) * pb]


def _adafactor_events(shapes: list[Shape], pb: int, shards: int = 1) -> list[Event]:
    """torch.optim._adafactor._single_tensor_adafactor (the CUDA default, foreach=None). Locals live until the loop
    rebinds them: row_mean, col_mean (>= 2-D), grad_squared (1-D), var_estimate / update (the parameter's size;
    the previous parameter's update is freed only when `update` is rebound, after the new var_estimate exists).
    param.norm / update.norm are 0-dim reads (.item()); row_var.mean(dim=-2, keepdim=True) is a [.., 1, 1] temp."""
    ev: list[Event] = []
    live: dict[str, tuple[int, int]] = {}     # local name -> (tag, bytes)
    tag = 0

    def bind(name: str, size: int) -> None:
        nonlocal tag
        ev.append((1, tag, size))
        old = live.get(name)
        live[name] = (tag, size)
        tag += 1
        if old is not None and not any(v[0] == old[0] for v in live.values()):
            ev.append((-1, old[0], old[1]))

    def rebind(name: str, other: str) -> None:
        old = live.get(name)
        live[name] = live[other]
        if old is not None and not any(v[0] == old[0] for v in live.values()):
            ev.append((-1, old[0], old[1]))

    for s in shapes:
        n = prod(s)
        if len(s) >= 2:
            bind("row_mean", prod(s[:-1]) * pb)
            bind("col_mean", prod(s[:-2]) * s[-1] * pb)
            bind("var_estimate", n * pb)
            bind("row_var_mean", prod(s[:-2]) * pb)
            _, size = live.pop("row_var_mean")
            ev.append((-1, tag - 1, size))
        else:
            bind("grad_squared", n * pb)
            bind("var_estimate", n * pb)
        rebind("update", "var_estimate")
    freed: set[int] = set()
    for t, size in live.values():
        if t not in freed:
            freed.add(t)
            ev.append((-1, t, size))
    return ev


# ------------------------------------------------------------------------------------------------ Muon

MUON_NS_STEPS = 5               # torch/optim/_muon.py: DEFAULT_NS_STEPS
NS_BYTES = 2                    # _zeropower_via_newtonschulz iterates in bfloat16 (grad.bfloat16())

_Tensor = tuple[int, int]       # a temporary of the step: (tag, bytes)


@dataclass
class _StepLog:
    """A step's allocation events, in order; each tensor allocated gets the next tag."""
    events: list[Event] = field(default_factory=list)
    tags: int = 0

    def alloc(self, size: int) -> _Tensor:
        self.events.append((1, self.tags, size))
        self.tags += 1
        return self.tags - 1, size

    def free(self, *tensors: _Tensor | None) -> None:
        self.events += [(-1, *t) for t in tensors if t is not None]

    def made(self, size: int, replaced: _Tensor | None, operand: _Tensor | None) -> _Tensor:
        """An op's output: it exists before its replicated operand, then the tensor it replaces, are released."""
        new = self.alloc(size)
        self.free(operand, replaced)
        return new

    def replicated(self, full: int | None, strided_local: int = 0) -> _Tensor | None:
        """Replicate a DTensor operand (`full` bytes; None: the op is local): all-gather (or all-reduce) output and
        its wait; a Shard(1) view (`strided_local` bytes) is made contiguous first and concatenated after. Returns
        the replicated tensor, to free after the op."""
        if full is None:
            return None
        contiguous = self.alloc(strided_local) if strided_local else None
        out = self.alloc(full)
        done = self.alloc(full)
        if contiguous is None:
            self.free(out)
            return done
        cat = self.alloc(full)
        self.free(done, out, contiguous)
        return cat


@dataclass(frozen=True)
class _NewtonSchulzBytes:
    """One parameter's Newton-Schulz tensors (rank-local bytes): X [r, c] (r, c: the smaller and the larger
    dimension), gram and gram_update [r, r], and the operand each matmul replicates on FSDP2's shards (None: the
    matmul is local)."""
    elements: int               # of the parameter (and of its gradient, its update)
    gram: int
    xt_replicated: int | None = None        # gram = X @ X.T: X.T all-gathered ...
    xt_strided: int = 0                     # ... from its Shard(1) view, made contiguous first
    gram_replicated: int | None = None      # addmm(gram, gram, gram): gram all-gathered or all-reduced
    x_operand_replicated: int | None = None     # addmm(X, gram_update, X): X gathered or gram_update reduced

    @property
    def x(self) -> int:
        return self.elements * NS_BYTES


def _newton_schulz_bytes(shape: Shape, shards: int) -> _NewtonSchulzBytes:
    """On FSDP2's DTensor shards (`shards` > 1: dim 0 split evenly over the ranks) each matmul's operands are
    placed as DTensor's sharding propagation chooses (torch 2.13, checked op by op against the trace), and the
    local tensors are the shards: without the transpose (rows <= columns, X Shard(0)) every matmul all-gathers one
    operand to a replicated copy (gram: X.T, a Shard(1) view, made contiguous, all-gathered and concatenated;
    gram_update: gram; X: X itself); with it (X Shard(1)) gram is a local matmul (Partial) and gram_update and X
    all-reduce their [r, r] operand. A functional collective's output and its wait_tensor are two tensors, as the trace records
    them. Uneven shards (DTensor pads them for the collective) are not modelled."""
    rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (prod(shape), 1)
    n = rows * cols
    if shards == 1:
        r = min(rows, cols)
        return _NewtonSchulzBytes(elements=n, gram=r * r * NS_BYTES)
    full_rows = rows * shards
    if full_rows > cols:                # transposed: X Shard(1), the global [r, r] gram Partial
        r = cols
        return _NewtonSchulzBytes(elements=n, gram=r * r * NS_BYTES, gram_replicated=r * r * NS_BYTES,
                                  x_operand_replicated=r * r * NS_BYTES)
    r = full_rows                       # X Shard(0), the global [r, r] gram Shard(0): [rows, r] here
    return _NewtonSchulzBytes(elements=n, gram=rows * r * NS_BYTES, xt_replicated=n * shards * NS_BYTES,
                              xt_strided=n * NS_BYTES, gram_replicated=full_rows * r * NS_BYTES,
                              x_operand_replicated=n * shards * NS_BYTES)


def _newton_schulz(log: _StepLog, b: _NewtonSchulzBytes, update: _Tensor, pb: int) -> _Tensor:
    """_zeropower_via_newtonschulz(update): ortho_grad = grad.bfloat16() (a bf16 copy unless the gradient is bf16
    already: then it is the update itself), transposed when it has more rows than columns, its 0-dim norm (a
    host-read scalar here, like the step counters), then MUON_NS_STEPS iterations of gram = X @ X.T [r, r],
    gram_update = addmm(gram, gram, gram) [r, r], X = addmm(X, gram_update, X) [r, c], each new tensor allocated
    before the one it replaces is released; at the return its gram and gram_update die. Returns the last X."""
    x = log.alloc(b.x) if pb != NS_BYTES else update        # grad.bfloat16()
    gram = gram_update = None
    for _ in range(MUON_NS_STEPS):
        # each new tensor exists before the operand copy and the tensor it replaces are released
        gram = log.made(b.gram, gram, log.replicated(b.xt_replicated, b.xt_strided))     # gram = X @ X.T
        gram_update = log.made(b.gram, gram_update, log.replicated(b.gram_replicated))   # addmm(gram, gram, gram)
        x = log.made(b.x, x if x != update else None,                                     # addmm(X, gram_update, X)
                     log.replicated(b.x_operand_replicated))
    log.free(gram, gram_update)
    return x


def _muon_events(shapes: list[Shape], pb: int, shards: int = 1) -> list[Event]:
    """torch.optim.Muon's step (torch 2.13, _single_tensor_muon, nesterov=True; foreach is not supported), one
    parameter after the other:
    - update = grad.lerp(buf, momentum): a copy of the gradient; the previous parameter's orthogonalised update,
      still bound to `update`, is freed only now;
    - _zeropower_via_newtonschulz (_newton_schulz; its tensors' sizes, on FSDP2's shards too: _newton_schulz_bytes),
      then the copy of the gradient dies;
    - param.mul_ / param.add_(update) in place. The last parameter's update dies when the step returns."""
    log = _StepLog()
    previous: _Tensor | None = None                  # the previous parameter's update
    for s in shapes:
        b = _newton_schulz_bytes(s, shards)
        update = log.alloc(b.elements * pb)          # update = grad.lerp(buf, momentum)
        log.free(previous)
        previous = _newton_schulz(log, b, update, pb)
        log.free(update)
    log.free(previous)
    return log.events


def _muon_part_of(param) -> int:
    """torch's Muon takes 2-D parameters of the hidden layers (its documentation: "Other parameters, such as bias,
    and embedding, should be optimized by a standard method such as AdamW"): the decoder layers' matrices."""
    return 0 if len(param.shape) == 2 and param.layer_index is not None else 1


# ------------------------------------------------------------------------------------------------ bitsandbytes

def _bnb_states(paged: bool, bits: int) -> Callable[[Shape, int], list[int]]:
    """Optimizer2State.init_state: fp32 state1/state2 for optim_bits=32 or parameters under min_8bit_size, else
    uint8 state1/state2 and fp32 absmax1/absmax2; get_state_buffer pages (cudaMallocManaged) state1/state2 of
    >= 1e5 elements of a paged optimizer, 32-bit ones included."""
    def states(shape: Shape, pb: int) -> list[int]:
        n = prod(shape)
        managed = paged and n >= BNB_PAGED_MIN_NUMEL
        if bits == 32 or n < BNB_MIN_8BIT_SIZE:
            return [] if managed else [n * F32, n * F32]   # 32-bit state1, state2 (fp32 whatever the param dtype)
        kept = [] if managed else [n, n]               # uint8 state1, state2 (paged: cudaMallocManaged)
        return kept + [bnb_blocks(n) * F32, bnb_blocks(n) * F32]   # fp32 absmax1, absmax2
    return states


def _bnb_qmaps(shapes: list[Shape], per_parameter: bool) -> int:
    """bitsandbytes' two 256-entry fp32 quantisation maps, made on the device at the first 8-bit parameter, once per
    optimizer (per parameter with --optimizer-in-backward: one optimizer each)."""
    eight_bit = sum(1 for s in shapes if prod(s) >= BNB_MIN_8BIT_SIZE)
    copies = eight_bit if per_parameter else min(eight_bit, 1)
    return copies * 2 * BNB_QMAP_ENTRIES * F32


def _bnb_paged_states(shape: Shape) -> int:
    """PagedAdamW8bit: state1/state2 of >= 1e5 elements are cudaMallocManaged (bnb F.get_paged). PyTorch's counters
    never see them; while resident (the update prefetches them to the GPU every step) they take device memory."""
    n = prod(shape)
    return 2 * n if n >= max(BNB_MIN_8BIT_SIZE, BNB_PAGED_MIN_NUMEL) else 0


def _bnb_paged_32bit_states(shape: Shape) -> int:
    """PagedAdamW (optim_bits=32): fp32 state1/state2 of >= 1e5 elements in managed memory, as _bnb_paged_states."""
    n = prod(shape)
    return 2 * n * F32 if n >= BNB_PAGED_MIN_NUMEL else 0


_BNB_PLAIN = ("{name} is modelled with single and ddp only (bitsandbytes' kernels take plain CUDA tensors, not "
              "FSDP2/TP DTensor shards); got {method}")
_BNB_LAYOUT = ("blockwise uint8 state1/state2 + fp32 absmax per 256 elements, fp32 states for parameters under 4096 "
               "elements, two shared 256-entry fp32 quantisation maps")
_BNB_ESTIMATE = ("bitsandbytes' state layout, modelled analytically (its CUDA kernels cannot run on fake tensors: the "
                 "trace uses an emulation with the same state tensors)")
_BNB_STEP = ("bitsandbytes' CUDA kernels cannot run on fake tensors (nor is bitsandbytes a dependency): an llmem "
             "emulation allocates exactly bnb's state tensors and updates in place (fused kernel: no temporaries)")
_PAGED_NOTE = ("{name}: states of >= 1e5 elements are CUDA managed memory (cudaMallocManaged): not in "
               "peak_allocated/peak_reserved (PyTorch's counters never see them) but in device_used (component "
               "managed_memory) while there is room: the driver evicts their pages to the host when the device is full, so "
               "they do not count against fitting")
_ADAFACTOR_NOTE = ("adafactor: torch.optim.Adafactor's default for-loop implementation (torch does not default it to "
                   "foreach on CUDA); factored row/col second moments for >= 2-D parameters")
IN_BACKWARD_NOTE = ("optimizer in backward: one optimizer per parameter stepped in its post-accumulate-grad hook; "
                    "its gradient is freed right after, states are created at the first backward")
_LION_NOTE = "lion: llmem.runtime.optimizers.Lion (the lion-pytorch update with foreach kernels)"


_BNB_32BIT_LAYOUT = ("fp32 state1/state2 of the parameter's shape (optim_bits=32: no quantisation maps, no "
                     "absmax)")


def _bnb_row(name: str, summary: str, paged: bool, bits: int = 8) -> OptimizerSpec:
    layout = _BNB_LAYOUT if bits == 8 else _BNB_32BIT_LAYOUT
    notes = [f"{name}: {_BNB_ESTIMATE}; {layout}"], [f"{name}: {_BNB_STEP}; {layout}"]
    if paged:
        notes[0].append(_PAGED_NOTE.format(name=name))
        notes[1].append(_PAGED_NOTE.format(name=name))
    outside = _nothing_outside if not paged else _bnb_paged_states if bits == 8 else _bnb_paged_32bit_states
    return OptimizerSpec(name=name, summary=summary, states=_bnb_states(paged, bits), step_events=_no_events,
                         step_scope=NO_TEMPORARIES, shared_state_bytes=_bnb_qmaps if bits == 8 else _no_shared,
                         outside_allocator_bytes=outside, plain_tensors_only=_BNB_PLAIN, low_bit=bits == 8,
                         paged=paged, estimate_notes=tuple(notes[0]), step_notes=tuple(notes[1]))


# ------------------------------------------------------------------------------------------------ torchao

# torchao/optim/adam.py (torchao 0.18.0): _AdamBase._new_buffer quantises a state when the parameter's local tensor
# (the DTensor shard's to_local()) has >= 4096 elements and a multiple of block_size; else torch.zeros_like(local_p)
TORCHAO_MIN_QUANT_SIZE = 4096


@dataclass(frozen=True)
class TorchaoStateFormat:
    """A torchao quantised state, as its subclass's `zeros` makes it (torchao 0.18.0, optim/subclass_*.py): codes
    (8 bits: the parameter's shape, uint8 or float8_e4m3fn; 4 bits: two per byte, flattened), one fp32 scale per
    block, and for the 8-bit and 4-bit formats a qmap, torch.tensor(qmap_list, float32) made for every state tensor
    (not shared). The signed map is exp_avg's, the unsigned one exp_avg_sq's."""
    torchao_class: str                  # torchao.optim's class
    block_size: int
    code_bits: int
    codes_dtype: str = "uint8"          # torch's name of the codes' dtype
    signed_qmap_entries: int = 0
    unsigned_qmap_entries: int = 0

    def quantised(self, numel: int) -> bool:
        return numel >= TORCHAO_MIN_QUANT_SIZE and numel % self.block_size == 0

    def state_bytes(self, numel: int, qmap_entries: int) -> list[int]:
        """One state's tensors, in creation order: codes, scale, qmap."""
        out = [numel * self.code_bits // 8, numel // self.block_size * F32]
        return out + [qmap_entries * F32] if qmap_entries else out


# OptimState8bit: create_dynamic_map(signed) has 2**8 entries; OptimState4bit: create_dynamic_map(True, 3, 4) and
# linspace(0, 1, 17)[1:], 16 entries each; OptimStateFp8: no qmap. block_size: AdamW8bit / AdamWFp8 256, AdamW4bit
# 128; transformers' adamw_torch_4bit passes block_size=256 (trainer_optimizer._get_torchao_optimizer)
TORCHAO_FORMATS: dict[str, TorchaoStateFormat] = {
    "torchao-adamw-8bit": TorchaoStateFormat("AdamW8bit", block_size=256, code_bits=8, signed_qmap_entries=256,
                                             unsigned_qmap_entries=256),
    "torchao-adamw-4bit": TorchaoStateFormat("AdamW4bit", block_size=128, code_bits=4, signed_qmap_entries=16,
                                             unsigned_qmap_entries=16),
    "torchao-adamw-4bit-b256": TorchaoStateFormat("AdamW4bit", block_size=256, code_bits=4,
                                                  signed_qmap_entries=16, unsigned_qmap_entries=16),
    "torchao-adamw-fp8": TorchaoStateFormat("AdamWFp8", block_size=256, code_bits=8, codes_dtype="float8_e4m3fn"),
}


def torchao_row(torchao_class: str, block_size: int) -> str | None:
    """The row of torchao's optimizer class `torchao_class` built with `block_size`; None when llmem has none."""
    return next((name for name, fmt in TORCHAO_FORMATS.items()
                 if fmt.torchao_class == torchao_class and fmt.block_size == block_size), None)


# what inductor's CPU code for single_param_adam holds per parameter of n elements (torch 2.13, read with
# TORCH_LOGS=output_code on torchao 0.18's optimizers); its CUDA code cannot be generated without a GPU
_INDUCTOR_CPU_BUFFERS = {
    "torchao-adamw-8bit": "two [n] fp32 buffers (the new exp_avg / exp_avg_sq before quantisation) and two [n / 256] "
                          "fp32: about 8 bytes per element",
    "torchao-adamw-4bit": "the unpacked codes ([n] uint8, twice), two [n] fp32, two [n] int64 indices and two "
                          "[n / 128] fp32: about 26 bytes per element",
    "torchao-adamw-4bit-b256": "the unpacked codes ([n] uint8, twice), two [n] fp32, two [n] int64 indices and two "
                               "[n / 256] fp32: about 26 bytes per element",
    "torchao-adamw-fp8": "two [n / 256] fp32 scales: about 1/32 byte per element",
}


def _torchao_states(fmt: TorchaoStateFormat) -> Callable[[Shape, int], list[int]]:
    def states(shape: Shape, pb: int) -> list[int]:
        n = prod(shape)
        if not fmt.quantised(n):
            return [n * pb, n * pb]                     # torch.zeros_like(local_p): the parameter's dtype
        return fmt.state_bytes(n, fmt.signed_qmap_entries) + fmt.state_bytes(n, fmt.unsigned_qmap_entries)
    return states


def _torchao_notes(name: str, fmt: TorchaoStateFormat) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """(estimate notes, step notes, sharded note) of a torchao row."""
    codes = f"{fmt.code_bits}-bit {fmt.codes_dtype}"
    qmap = f" and its own {fmt.signed_qmap_entries}-entry fp32 qmap" if fmt.signed_qmap_entries else ""
    layout = (f"{name}: torchao 0.18's states: for a parameter of >= {TORCHAO_MIN_QUANT_SIZE} elements and a "
              f"multiple of {fmt.block_size}, exp_avg and exp_avg_sq as {codes} codes, one fp32 scale per "
              f"{fmt.block_size} elements{qmap}; other parameters keep both states in their own dtype")
    step = (f"{name}: the step (torch.compile of torchao's single_param_adam, one kernel per parameter) is modelled "
            "as updating the states and the parameter in place with no temporaries; inductor's CUDA buffers cannot "
            "be generated here: its CPU code for the same graph holds, for the parameter being stepped (n elements), "
            f"{_INDUCTOR_CPU_BUFFERS[name]}; its autotuner also clones the kernel's arguments at the first step")
    emulated = (f"{name}: torchao's compiled step cannot run on fake tensors: an llmem emulation allocates exactly "
                "torchao's state tensors and updates the parameter in place")
    sharded = (f"{name} on FSDP2's shards: torchao wraps each state in a DTensor of the parameter's placements, made "
               f"from the local shard: the {TORCHAO_MIN_QUANT_SIZE}-element and block-size tests are on the shard")
    return (layout, step), (layout, step, emulated), sharded


_TORCHAO_TP = ("{name} with {method}: torchao's low-bit states on tensor-parallel DTensor shards are not modelled; use "
               "single, ddp, fsdp or zero2")


def _torchao_row(name: str, summary: str) -> OptimizerSpec:
    fmt = TORCHAO_FORMATS[name]
    estimate_notes, step_notes, sharded = _torchao_notes(name, fmt)
    return OptimizerSpec(name=name, summary=summary, states=_torchao_states(fmt), step_events=_no_events,
                         step_scope=NO_TEMPORARIES, tp_refusal=_TORCHAO_TP, low_bit=True,
                         estimate_notes=estimate_notes, step_notes=step_notes, sharded_notes=(sharded,))


_ADAMW = OptimizerSpec(name="adamw", summary="torch AdamW, foreach (the CUDA default)", states=_adam_states,
                       step_events=_foreach_copy_events, step_scope=PER_GROUP, redistribute=AFTER_TEMPORARIES,
                       adam=True, event_param=_tag_is_param)
_MUON_PART = OptimizerSpec(name="muon-matrices", summary="torch Muon over the hidden layers' matrices",
                           states=_one_state, step_events=_muon_events, step_scope=ALL_PARAMETERS)
_MUON_NOTE = ("muon: torch.optim.Muon (single-tensor; Newton-Schulz in bf16) over the decoder layers' 2-D weights, "
              "torch.optim.AdamW (foreach) over the other parameters (embeddings, lm_head, norms, biases), stepped "
              "Muon first, as torch's documentation pairs them")
_MUON_SHARDED_NOTE = ("muon on FSDP2 shards: DTensor's redistributions of the Newton-Schulz matmuls are modelled as "
                      "torch 2.13 places them on 2 shards (checked op by op against the trace); on more shards DTensor "
                      "places some differently, so the step's temporaries are approximate (within 3 % of the trace "
                      "at 4 and 8 shards)")

OPTIMIZERS: dict[str, OptimizerSpec] = {o.name: o for o in (
    _ADAMW,
    OptimizerSpec(name="adamw-fused", summary="torch AdamW(fused=True)", states=_adam_states,
                  step_events=_no_events, step_scope=NO_TEMPORARIES, host_step_counters=False, adam=True),
    OptimizerSpec(name="adamw-forloop", summary="torch AdamW(foreach=False)", states=_adam_states,
                  step_events=_forloop_adamw_events, step_scope=ALL_PARAMETERS, adam=True,
                  event_param=_two_tags_a_param),
    OptimizerSpec(name="sgd", summary="torch SGD without momentum", states=_no_states,
                  step_events=_no_events, step_scope=NO_TEMPORARIES),
    OptimizerSpec(name="sgd-momentum", summary="torch SGD(momentum=0.9)", states=_one_state,
                  step_events=_no_events, step_scope=NO_TEMPORARIES),
    OptimizerSpec(name="adafactor", summary="torch Adafactor (its default for-loop implementation)",
                  states=_adafactor_states, step_events=_adafactor_events, step_scope=PER_GROUP,
                  plain_tensors_only=("{name} with {method}: torch.optim.Adafactor fails on DTensor parameters "
                                      "(torch.norm(grad, dim=-2).square_() cannot keep the _NormPartial placement in "
                                      "place); use single or ddp"),
                  estimate_notes=(_ADAFACTOR_NOTE,), step_notes=(_ADAFACTOR_NOTE,)),
    OptimizerSpec(name="lion", summary="Lion (lion-pytorch's update, foreach kernels)", states=_one_state,
                  step_events=_foreach_copy_events, step_scope=PER_GROUP, redistribute=AT_FIRST_FREE,
                  event_param=_tag_is_param, estimate_notes=(_LION_NOTE,), step_notes=(_LION_NOTE,)),
    OptimizerSpec(name="muon", summary="torch Muon for the hidden layers' matrices, AdamW for the rest",
                  states=_one_state, step_events=_muon_events, step_scope=PER_GROUP,
                  parts=(_MUON_PART, _ADAMW), part_of=_muon_part_of,
                  tp_refusal=("{name} with {method}: torch.optim.Muon's Newton-Schulz iteration on tensor-parallel "
                              "DTensor shards is not modelled; use single, ddp, fsdp or zero2"),
                  estimate_notes=(_MUON_NOTE,), step_notes=(_MUON_NOTE,), sharded_notes=(_MUON_SHARDED_NOTE,)),
    _bnb_row("adamw-8bit", "bitsandbytes AdamW8bit", paged=False),
    _bnb_row("paged-adamw-8bit", "bitsandbytes PagedAdamW8bit", paged=True),
    _bnb_row("paged-adamw-32bit", "bitsandbytes PagedAdamW (32-bit states in managed memory)", paged=True, bits=32),
    _torchao_row("torchao-adamw-8bit", "torchao AdamW8bit (block 256)"),
    _torchao_row("torchao-adamw-4bit", "torchao AdamW4bit (block 128, torchao's default)"),
    _torchao_row("torchao-adamw-4bit-b256", "torchao AdamW4bit(block_size=256), as transformers' adamw_torch_4bit"),
    _torchao_row("torchao-adamw-fp8", "torchao AdamWFp8 (block 256)"),
)}
EIGHT_BIT_ALTERNATIVE = "adamw-8bit"   # the planner's 8-bit saver for an Adam(W)


def optimizer_spec(name: str) -> OptimizerSpec:
    spec = OPTIMIZERS.get(name)
    if spec is None:
        raise LlmemError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
    return spec


def step_peak_bytes(events: list[Event]) -> int:
    """The most bytes a step's temporaries hold at once."""
    held = peak = 0
    for sign, _tag, size in events:
        held += sign * size
        peak = max(peak, held)
    return peak
