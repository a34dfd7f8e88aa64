"""Quantised frozen bases: one row per `TrainingSetup.quant_base`, registered by name.

A row says what the base IS as a set-up: its flag, the library that quantises it, whether peft's
`prepare_model_for_kbit_training` upcast runs on it (the HF / TRL / axolotl QLoRA recipe over bitsandbytes; torchtune,
which runs torchao's NF4Tensor, has no such step), whether double quantisation is a choice, the precisions the
recipe trains in. How a base is STORED (its tensors, FSDP2's shards, its matmuls' transients) is the memory floor's
row of the same name (llmem.memory.quant.QUANT_LAYOUTS).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmem.errors import LlmemError


def _check_int8(setup: Any, flag: str) -> None:
    """bitsandbytes' LLM.int8 under peft: autocast or fp32 (Linear8bitLt's weight is int8, not a float dtype)."""
    pure_low = setup.precision_spec.low_precision and not setup.precision_spec.mixed
    if pure_low:
        raise LlmemError(f"{flag} with --precision {setup.precision}: pure low-precision LLM.int8 is not "
                         f"modelled; use --precision {setup.precision}-mixed or fp32")
    if setup.adapter_dtype == "base" and setup.precision_spec.low_precision:
        raise LlmemError(f"{flag} with --adapter-dtype base: peft casts adapters to the base layer's dtype "
                         "only when it is a float dtype, and Linear8bitLt's is int8, so they stay fp32; drop "
                         "--adapter-dtype base")


def _check_torchao(setup: Any, flag: str) -> None:
    """torchtune's LoRA recipes: fp32 or bf16, no autocast, adapters built in the model's dtype."""
    pure_low = setup.precision_spec.low_precision and not setup.precision_spec.mixed
    if setup.precision_spec.mixed or setup.precision == "fp16":
        raise LlmemError(f"{flag} runs torchtune's QLoRA, which trains in fp32 or pure bf16 (no autocast, no "
                         "fp16): use --precision bf16 or fp32")
    if pure_low and setup.adapter_dtype == "fp32":
        raise LlmemError(f"{flag}: torchtune's LoRALinear keeps its adapters in the model dtype: add "
                         "--adapter-dtype base")
    if not setup.double_quant:
        raise LlmemError(f"{flag}: torchao's NF4Tensor always quantises its scalers (drop "
                         "--no-double-quant)")


@dataclass(frozen=True)
class QuantBaseSpec:
    """One `--qlora`-style choice of frozen base."""
    name: str                        # TrainingSetup.quant_base
    flag: str                        # its command-line switch ("" for none)
    help: str
    library: str                     # bitsandbytes, torchao ("" for none)
    quantised: bool                  # the frozen base's linears are quantised
    # peft's prepare_model_for_kbit_training runs (unless --no-kbit-upcast): the unquantised frozen parameters
    # (embeddings, norms, lm_head) upcast to fp32 (the HF/TRL/axolotl QLoRA recipe on bitsandbytes)
    kbit_prep: bool = False
    double_quant_optional: bool = False   # --no-double-quant applies (bitsandbytes' bnb_4bit_use_double_quant)
    # FSDP2 can shard its storage (bitsandbytes has no float storage for LLM.int8's int8 weights, unlike NF4's
    # bnb_4bit_quant_storage); llmem.memory.quant's row says which of its tensors
    fsdp_shards: bool = True
    # FSDP2's CPUOffloadPolicy moves its sharded storage to the host as it does a plain parameter's (bitsandbytes'
    # Params4bit, packed in the compute dtype: FSDP-QLoRA); torchao's NF4Tensor copies through its subclass (not
    # modelled)
    host_offload: bool = False
    # torch.compile traces its dequantisation into each compiled layer's graph (torchao's NF4Tensor: a traceable
    # subclass whose `to` is get_original_weight's torch ops, torchao/dtypes/nf4tensor.py); bitsandbytes' CUDA
    # kernels are not laid out compiled
    compiled: bool = False
    # transformers' bitsandbytes 4-bit quantizer sets model.is_loaded_in_4bit (quantizer_bnb_4bit.py), which
    # trl.experimental's ORPO / CPO trainers read for peft_module_casting_to_bf16 (the 8-bit one: is_loaded_in_8bit)
    loaded_in_4bit: bool = False
    adapter_kind: str = "LoRA"       # what LoRA adapters on this base are called (QLoRA: LoRA on a 4-bit NF4 base)
    base_text: str = ""              # the setup record's words for it ("nf4 base")
    check: Callable[[Any, str], None] | None = None   # the precisions / adapter dtypes its recipe trains in

    def host_offload_refusal(self, method: str) -> str | None:
        """Why FSDP2's CPUOffloadPolicy of this base is not modelled under `method` (None: it is, or the base is
        not quantised)."""
        if not self.quantised or self.host_offload:
            return None
        return (f"--offload-param with a {self.flag} base under {method} is not modelled (FSDP2 copies its shard "
                "through the tensor subclass): drop --offload-param, or use --qlora (bitsandbytes)")

    @property
    def bitsandbytes(self) -> bool:
        """bitsandbytes' linears under peft: they return their input's dtype, and peft's bitsandbytes LoRA layers
        (lora/bnb.py) wrap them."""
        return self.library == "bitsandbytes"


QUANT_BASES: dict[str, QuantBaseSpec] = {q.name: q for q in (
    QuantBaseSpec("none", "", "an unquantised frozen base", "", False),
    QuantBaseSpec("nf4", "--qlora", "frozen base in bitsandbytes' 4-bit NF4 (QLoRA); needs adapters (--lora-rank)",
                  "bitsandbytes", True, kbit_prep=True, double_quant_optional=True, host_offload=True,
                  loaded_in_4bit=True, adapter_kind="QLoRA", base_text="nf4 base"),
    QuantBaseSpec("int8", "--load-in-8bit", "frozen base in bitsandbytes' LLM.int8 (Linear8bitLt); needs adapters "
                  "(--lora-rank)", "bitsandbytes", True, kbit_prep=True, fsdp_shards=False, base_text="int8 base",
                  check=_check_int8),
    QuantBaseSpec("torchao-nf4", "--qlora-torchao", "frozen base in torchao's NF4Tensor (torchtune's QLoRA); needs "
                  "adapters (--lora-rank)", "torchao", True, compiled=True, adapter_kind="QLoRA",
                  base_text="torchao nf4 base",
                  check=_check_torchao),
)}
QUANTISED = tuple(name for name, q in QUANT_BASES.items() if q.quantised)
# TrainingSetup.quant_base's flags: (flag, value, help)
QUANT_SWITCHES = tuple((q.flag, q.name, q.help) for q in QUANT_BASES.values() if q.flag)


def quant_base_spec(name: str) -> QuantBaseSpec:
    spec = QUANT_BASES.get(name)
    if spec is None:
        raise LlmemError(f"unknown quantised base {name!r}: choose one of {', '.join(QUANT_BASES)}")
    return spec
