"""A quantised frozen base: bitsandbytes' NF4 (QLoRA) and LLM.int8, torchao's NF4Tensor (torchtune's QLoRA): the
tensors each library stores per weight, which of them FSDP2 shards, and what their matmuls allocate.

Neither library's kernels run on fake tensors (or without a GPU), so llmem models them and, for the trace, emulates
them (llmem.runtime.quant_kernels): every tensor the library allocates is allocated with the same shape and dtype
by plain torch ops. One registry row per quantised base (`QUANT_LAYOUTS`) holds its storage, sharding and transients.

Which modules are quantised: every `nn.Linear` (and GPT-2's Conv1D) except the output embedding and tied weights
(transformers' `replace_with_bnb_linear` / `get_keys_to_not_convert`; torchtune's QLoRA builders make every linear
of the decoder layers a FrozenNF4Linear or an NF4 LoRALinear and keep the output projection unquantised).

The unquantised frozen parameters (embeddings, norms, lm_head): fp32 when peft's `prepare_model_for_kbit_training`
runs (TrainingSetup.kbit_upcasts: the HF/TRL QLoRA recipe on one GPU or DDP); it casts every fp16/bf16 parameter
whose class is not Params4bit, so with bitsandbytes' linears returning their input's dtype the residual stream is
then fp32 (under autocast the MLP's intermediates too: activations.with_fp32_mlp; under pure bf16 every activation:
setup.precision.regime_for). TRL's SFTTrainer and axolotl skip it for FSDP-QLoRA; torchtune never runs it.

Storage per quantised weight of n = out x in elements:
- bitsandbytes nf4 (0.4x-0.50, `quantize_4bit` / `Params4bit`): the packed weight [(n + 1) // (2 x s), 1] in
  `bnb_4bit_quant_storage` (itemsize s: uint8 by default; the compute dtype for FSDP-QLoRA, Answer.AI's recipe,
  TRL's and axolotl's docs, so FSDP can shard it as a float tensor); the NF4 code table, fp32 [16]
  (`get_4bit_type` makes one per weight); absmax per 64-element block: fp32 [ceil(n/64)], or with double
  quantisation (`compress_statistics`) uint8 [ceil(n/64)] + the nested state: fp32 absmax per 256 of those blocks,
  its own copy of the 8-bit dynamic code (fp32 [256], `quantize_blockwise` copies it per call) and the fp32 offset
  (a 0-d tensor). Under FSDP the packed weight is the parameter FSDP shards; the QuantState (absmax, codes, offset)
  is an attribute of the module, replicated on every rank (Linear4bit.forward re-attaches it to the gathered weight:
  `fix_4bit_weight_quant_state_from_module`).
- bitsandbytes int8: the weight, int8 [out, in], and its row scales SCB, fp32 [out]. FSDP cannot shard it (no
  float storage option).
- torchao nf4 (torchao NF4Tensor, `to_nf4(w, block_size=64, scaler_block_size=256)` as torchtune calls it): the
  packed quantized_data uint8 [n/2], quantized_scalers int8 [n/64] (double quantisation is built in), the
  quantization_factor per 256 scalers [n/16384] in the weight's dtype, scaler_mean (0-d) and the nf4 table [16] in
  that dtype. `from_tensor` asserts n % 64 == 0 and (n / 64) % 256 == 0. Under FSDP2 the first three are split
  along dim 0 (`nf4_split`: every inner tensor's numel must divide by the shard count, and so must dim 0: FSDP2's
  narrow on NF4Tensor takes no padding) and all-gathered in their own dtypes (`fsdp_pre_all_gather` returns
  quantized_scalers, quantization_factor, quantized_data; FSDP2 gathers mixed dtypes as one uint8 buffer);
  scaler_mean and nf4 stay replicated (metadata of `fsdp_post_all_gather`).
Nothing is shared between layers.

Transients (CUDA path), as events in allocation order (the matmul output aside):
- bnb nf4 forward (`MatMul4Bit.forward` -> `gemm_4bit`): with more than 1536 rows (tokens of the micro-batch) CUDA
  takes `_dequant_linear_fallback`: with double quantisation the fp32 absmax [ceil(n/64)] and absmax + offset (both
  live), then the dequantised weight [out, in] in the compute dtype, then F.linear. Up to 1536 rows it may take a
  fused kernel with no transient (arch-dependent heuristics); llmem always models the fallback (an upper bound by
  one dequantised weight for short micro-batches). Nothing of the input is kept: the weight is frozen
  (ctx.tensors holds the packed weight only).
- bnb nf4 backward (`F.dequantize_4bit`): the fp32 absmax (double quantisation), the dequantised weight [out, in] in
  the quantisation dtype (QuantState.dtype: the dtype the weight was loaded in, the compute dtype), then
  grad_output @ W for the input gradient.
- int8 forward (`MatMul8bitLt.forward`): the input cast to fp16 (unless it is fp16), its int8 copy CA [t, in] and
  row scales SCA fp32 [t], the int32 product [t, out], then the output; the input itself stays referenced by the
  function (ctx.tensors) until backward. Outlier columns (threshold 6.0) depend on the data: none are modelled.
- int8 backward: the weight dequantised to the input dtype [out, in] (CB.to(dtype).mul_(SCB / 127)), then
  grad_output @ W.
- torchao nf4, forward and backward alike (`LinearNF4`: F.linear(x, w.to(x.dtype)), and grad_output @
  w.to(grad.dtype); it saves only the NF4 weight): `NF4Tensor.get_original_weight` in eager mode: the two nibble
  planes (`>> 4`, `& 0b1111`: uint8 [n/2] each, freed once cast) cast to int64 [n/2] each, the nf4 table looked up
  for each (dtype [n/2]), the scalers dequantised (int8 / factor: [n/64], then + scaler_mean), each plane times a
  flattened copy of the expanded scalers (copy [n/2], freed; product [n/2]), then torch.stack: the dequantised
  weight [out, in]; the int64 planes and the products live until it returns (14 n bytes at the stack for a bf16
  weight, 7x the weight itself). Checked allocation by allocation against torchao 0.18 on fake tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llmem.errors import LlmemError
from llmem.model.adapter_params import is_adapter_param
from llmem.model.sharding import MATMUL_KINDS, unwrapped_module
from llmem.setup.precision import F32
from llmem.setup.quant_bases import QUANTISED, quant_base_spec
from llmem.units import ceil_div

NF4_BLOCK = 64                  # Params4bit blocksize (transformers' BitsAndBytesConfig default); torchao block_size
NESTED_BLOCK = 256              # quantize_blockwise(absmax, blocksize=256); torchao scaler_block_size (torchtune)
NF4_CODE_BYTES = 16 * 4         # get_4bit_type("nf4"): fp32 [16]
DYNAMIC_CODE_BYTES = 256 * 4    # create_dynamic_map(): fp32 [256], copied into each nested QuantState
GEMM_4BIT_CUSTOM_MAX_ROWS = 1536   # bitsandbytes/backends/cuda/ops.py: past this, dequantise + F.linear
AO_QUANT_UNIT = NF4_BLOCK * NESTED_BLOCK   # to_nf4: numel % 64 == 0 and (numel / 64) % 256 == 0
INT64 = 8

Event = tuple[int, int, int]    # (+1 allocate / -1 free, tag, bytes)


@dataclass(frozen=True)
class QuantArgs:
    """What a weight's quantised layout depends on besides its shape."""
    double_quant: bool = True   # bitsandbytes nf4's compress_statistics
    dtype_bytes: int = 2        # the compute dtype: bitsandbytes' compute and QuantState dtype, NF4Tensor's dtype
    storage_bytes: int = 1      # itemsize of bitsandbytes' bnb_4bit_quant_storage (uint8; the compute dtype under FSDP)


@dataclass(frozen=True)
class Transients:
    """What a quantised linear allocates around its matmuls, as events: what they leave allocated lives until the
    matmul's output is made, then is freed."""
    forward: tuple[Event, ...]
    backward: tuple[Event, ...]


def allocated(events: tuple[Event, ...]) -> tuple[int, ...]:
    """The sizes the events allocate, in order."""
    return tuple(n for sign, _, n in events if sign > 0)


def events_peak(events: tuple[Event, ...]) -> int:
    """The most bytes the events hold at once."""
    live: dict[int, int] = {}
    peak = 0
    for sign, tag, n in events:
        if sign > 0:
            live[tag] = n
            peak = max(peak, sum(live.values()))
        else:
            live.pop(tag)
    return peak


def _allocs(*sizes: int) -> tuple[Event, ...]:
    return tuple((1, k, n) for k, n in enumerate(sizes))


# ------------------------------------------------------------------------------------------ bitsandbytes NF4
def nf4_storage_tensors(numel: int, double_quant: bool, storage_bytes: int = 1) -> tuple[int, ...]:
    """Bytes of each tensor bitsandbytes keeps for one NF4 weight of `numel` elements (allocation order): the
    packed weight first (the one FSDP shards)."""
    blocks = ceil_div(numel, NF4_BLOCK)
    packed = (numel + 1) // (2 * storage_bytes) * storage_bytes    # _quantize_4bit's out, in quant_storage
    if not double_quant:
        return (packed, blocks * F32, NF4_CODE_BYTES)
    return (packed, blocks, ceil_div(blocks, NESTED_BLOCK) * F32, DYNAMIC_CODE_BYTES, F32, NF4_CODE_BYTES)


def _bnb_nf4_tensors(out_f: int, in_f: int, a: QuantArgs) -> tuple[tuple[int, int], ...]:
    sizes = nf4_storage_tensors(out_f * in_f, a.double_quant, a.storage_bytes)
    return ((sizes[0] // a.storage_bytes, a.storage_bytes),) + tuple((n, 1) for n in sizes[1:])


def _bnb_nf4_transients(out_f: int, in_f: int, a: QuantArgs, tokens: int, input_fp16: bool) -> Transients:
    n = out_f * in_f
    blocks = ceil_div(n, NF4_BLOCK)
    absmax = (blocks * F32, blocks * F32) if a.double_quant else ()
    w = n * a.dtype_bytes
    return Transients(_allocs(*absmax, w), _allocs(*absmax[:1], w))


# ------------------------------------------------------------------------------------------ bitsandbytes int8
def int8_storage_tensors(out_features: int, in_features: int) -> tuple[int, ...]:
    """Int8Params: the int8 weight [out, in] and SCB, fp32 [out]."""
    return (out_features * in_features, out_features * F32)


def _int8_tensors(out_f: int, in_f: int, a: QuantArgs) -> tuple[tuple[int, int], ...]:
    return tuple((n, 1) for n in int8_storage_tensors(out_f, in_f))


def _int8_transients(out_f: int, in_f: int, a: QuantArgs, tokens: int, input_fp16: bool) -> Transients:
    fp16_copy = () if input_fp16 else (tokens * in_f * 2,)
    # int8_vectorwise_quant(A.to(fp16)): CA int8 [t, in], SCA fp32 [t]; int8_linear_matmul: int32 [t, out]
    fwd = fp16_copy + (tokens * in_f, tokens * F32, tokens * out_f * 4)
    return Transients(_allocs(*fwd), _allocs(out_f * in_f * a.dtype_bytes, out_f * F32))


# ------------------------------------------------------------------------------------------ torchao NF4Tensor
def torchao_nf4_storage_tensors(numel: int, dtype_bytes: int) -> tuple[int, ...]:
    """Bytes of NF4Tensor's inner tensors for one weight of `numel` elements in a `dtype_bytes` dtype: quantized_data,
    quantized_scalers, quantization_factor (the three FSDP2 shards), scaler_mean, nf4."""
    return (numel // 2, numel // NF4_BLOCK, numel // AO_QUANT_UNIT * dtype_bytes, dtype_bytes, 16 * dtype_bytes)


def _ao_tensors(out_f: int, in_f: int, a: QuantArgs) -> tuple[tuple[int, int], ...]:
    n, e = out_f * in_f, a.dtype_bytes
    return ((n // 2, 1), (n // NF4_BLOCK, 1), (n // AO_QUANT_UNIT, e), (1, e), (16, e))


def torchao_dequantise_events(numel: int, dtype_bytes: int) -> tuple[Event, ...]:
    """NF4Tensor.get_original_weight (torchao 0.18, eager): what it allocates and frees, leaving the weight."""
    half, e = numel // 2, dtype_bytes
    return ((1, 0, half), (1, 1, half * INT64), (-1, 0, 0),          # (qd >> 4).to(torch.long)
            (1, 2, half), (1, 3, half * INT64), (-1, 2, 0),          # (qd & 0b1111).to(torch.long)
            (1, 4, half * e), (1, 5, half * e),                      # nf4[first], nf4[second]
            (1, 6, numel // NF4_BLOCK * e), (1, 7, numel // NF4_BLOCK * e), (-1, 6, 0),   # scalers / factor + mean
            (1, 8, half * e), (1, 9, half * e), (-1, 8, 0),          # repeated.flatten() (a copy), first * it
            (1, 10, half * e), (1, 11, half * e), (-1, 10, 0),       # the same for the second plane
            (1, 12, numel * e),                                      # torch.stack: the weight
            *((-1, k, 0) for k in (1, 3, 4, 5, 7, 9, 11)))           # the locals die at return


def _ao_transients(out_f: int, in_f: int, a: QuantArgs, tokens: int, input_fp16: bool) -> Transients:
    events = torchao_dequantise_events(out_f * in_f, a.dtype_bytes)
    return Transients(events, events)


def _ao_check(p, out_f: int, in_f: int, shards: int, flag: str) -> None:
    """torchao's to_nf4 needs n % (64 x 256) == 0; under FSDP2 its nf4_split needs dim 0 and every inner tensor to
    divide by the shards."""
    n = out_f * in_f
    if n % AO_QUANT_UNIT:
        raise LlmemError(f"{flag}: torchao's to_nf4 needs every weight's size to divide by {NF4_BLOCK} x "
                         f"{NESTED_BLOCK} (block_size x scaler_block_size); {p.name} {list(p.shape)} "
                         "does not: use --qlora (bitsandbytes)")
    if shards > 1 and (out_f % shards or (n // AO_QUANT_UNIT) % shards):
        raise LlmemError(f"{flag} over {shards} FSDP2 shards: NF4Tensor splits dim 0 and its scale tensors "
                         f"evenly only; {p.name} {list(p.shape)} has {n // AO_QUANT_UNIT} scale blocks "
                         f"and {out_f} rows, not divisible by {shards}: use fewer GPUs or --qlora")


# ------------------------------------------------------------------------------------------ the registry
@dataclass(frozen=True)
class QuantLayout:
    """One quantised base as its library holds and runs a weight (what the base is, its library and flag:
    llmem.setup.quant_bases, the row of the same name)."""
    name: str                                  # TrainingSetup.quant_base
    kind: str                                  # what the notes call it
    tensors: Callable[[int, int, QuantArgs], tuple[tuple[int, int], ...]]   # (numel, itemsize) per stored tensor
    sharded: int                               # how many leading tensors FSDP2 shards (0: it cannot)
    transients: Callable[[int, int, QuantArgs, int, bool], Transients]
    # the matmul keeps its input for backward even with a frozen weight (MatMul8bitLt's ctx.tensors)
    keeps_inputs: bool = False
    # bitsandbytes' Linear4bit.forward: gemm_4bit's output in the compute dtype, cast back to its input's dtype
    # (out.to(inp_dtype)), which peft's 4-bit LoRA layer clones before adding the adapters (estimator's schedule)
    casts_output: bool = False
    # what the estimate's notes add to `kind`, given double quantisation (--no-double-quant: False)
    detail: Callable[[bool], str] | None = None
    check: Callable[..., None] | None = None   # refuses a weight the library cannot quantise / FSDP2 cannot shard

    @property
    def library(self) -> str:
        return quant_base_spec(self.name).library

    def storage_text(self, double_quant: bool) -> str:
        """The storage in words, for the notes: `kind` and the row's detail."""
        return self.kind + (self.detail(double_quant) if self.detail is not None else "")


QUANT_LAYOUTS: dict[str, QuantLayout] = {q.name: q for q in (
    QuantLayout("nf4", "NF4 4-bit", _bnb_nf4_tensors, 1, _bnb_nf4_transients, casts_output=True,
                detail=lambda double: ", double-quantised constants" if double else ", fp32 absmax"),
    QuantLayout("int8", "LLM.int8", _int8_tensors, 0, _int8_transients, keeps_inputs=True),
    QuantLayout("torchao-nf4", "NF4Tensor", _ao_tensors, 3, _ao_transients, check=_ao_check,
                detail=lambda double: " (block 64, scalers double-quantised per 256)"),
)}


def quant_layout(quant_base: str) -> QuantLayout:
    if quant_base not in QUANT_LAYOUTS:
        raise LlmemError(f"unknown quantised base {quant_base!r}: choose one of {', '.join(QUANTISED)}")
    return QUANT_LAYOUTS[quant_base]


def quant_args(setup, sharded: bool) -> QuantArgs:
    """A set-up's QuantArgs (a TrainingSetup): bitsandbytes' packed storage is in the compute dtype when FSDP2
    shards it (bnb_4bit_quant_storage, the FSDP-QLoRA recipe), uint8 otherwise."""
    return QuantArgs(setup.double_quant, setup.compute_bytes, setup.compute_bytes if sharded else 1)


def _out_in(shape: tuple[int, ...], conv1d: bool) -> tuple[int, int]:
    return (shape[1], shape[0]) if conv1d else (shape[0], shape[1])


def check_quantisable(p, quant_base: str, shards: int = 1) -> None:
    """Refuse a weight the library cannot quantise (or FSDP2 cannot shard) as the set-up asks (the row's check)."""
    q = QUANT_LAYOUTS.get(quant_base)
    if q is not None and q.check is not None:
        out_f, in_f = _out_in(p.shape, p.module_kind == "Conv1D")
        q.check(p, out_f, in_f, shards, quant_base_spec(quant_base).flag)


def storage_tensors(shape: tuple[int, ...], quant_base: str, args: QuantArgs, conv1d: bool = False,
                    shards: int = 1, offloaded: bool = False) -> tuple[int, ...]:
    """Bytes of every tensor a quantised weight of this (module) shape is stored as on one rank's GPU: FSDP2's
    dim-0 shard (padded to a multiple of `shards`) of the tensors it shards, the rest whole (replicated);
    `offloaded`: under FSDP2's CPUOffloadPolicy the sharded ones are on the host (QuantBaseSpec.host_offload)."""
    q = quant_layout(quant_base)
    tensors = q.tensors(*_out_in(shape, conv1d), args)
    return tuple(ceil_div(n, shards) * s if i < q.sharded and shards > 1 else n * s
                 for i, (n, s) in enumerate(tensors) if not (offloaded and i < q.sharded))


def gathered_tensors(shape: tuple[int, ...], quant_base: str, args: QuantArgs, shards: int,
                     conv1d: bool = False) -> tuple[int, ...]:
    """Bytes of FSDP2's all-gather outputs of a quantised weight (one per sharded tensor, in its storage dtype):
    bitsandbytes' packed weight; NF4Tensor's quantized_scalers, quantization_factor and quantized_data."""
    q = quant_layout(quant_base)
    if not q.sharded:
        raise LlmemError(f"{quant_base_spec(quant_base).flag}: FSDP2 cannot shard {q.library}'s {q.kind} storage")
    tensors = q.tensors(*_out_in(shape, conv1d), args)[:q.sharded]
    return tuple(ceil_div(n, shards) * shards * s for n, s in tensors)


def is_quantised(p, quant_base: str) -> bool:
    """Whether the quantised base replaces this parameter's module (a ParamInfo): the weight of an nn.Linear /
    Conv1D that is not the output embedding nor tied (LoRA adapters are never quantised)."""
    if not quant_base_spec(quant_base).quantised or not p.name.endswith(".weight") \
            or p.module_kind not in MATMUL_KINDS:
        return False
    # (peft's modules_to_save wraps the module after loading: its original and its trained copy are the module's)
    module = unwrapped_module(p.name)
    return not is_adapter_param(p.name) and p.tied_to is None and module.rsplit(".", 1)[-1] != "lm_head"


def storage_bytes(p, quant_base: str, args: QuantArgs, shards: int = 1, offloaded: bool = False) -> int:
    return sum(storage_tensors(p.shape, quant_base, args, p.module_kind == "Conv1D", shards, offloaded))


def transients(shape: tuple[int, ...], quant_base: str, args: QuantArgs, tokens: int, input_fp16: bool,
               conv1d: bool = False) -> Transients:
    """What the library's matmul allocates besides its output (forward) and the input gradient (backward).

    args.dtype_bytes: bitsandbytes nf4 and torchao dequantise to it; int8 dequantises its weight to the input's
    dtype in backward (pass that dtype); input_fp16: int8 casts a non-fp16 input to fp16."""
    return quant_layout(quant_base).transients(*_out_in(shape, conv1d), args, tokens, input_fp16)
