"""FSDP-QLoRA with FSDP2's CPUOffloadPolicy (--qlora --offload-param, axolotl's qlora-fsdp-70b with
fsdp_offload_params): bitsandbytes' packed NF4 weight is FSDP2's sharded parameter, so it goes to the host with the
adapters, their gradients and the optimizer; the quantisation state (absmax, the nested constants and the code
books: attributes of Params4bit) stays on every GPU. Checked by hand and against the trace, which runs
CPUOffloadPolicy over the emulated Linear4bit."""

from __future__ import annotations

import pytest

from llmem import estimate
from llmem.errors import LlmemError
from llmem.runtime.trace import trace
from llmem.setup.training import user_setup

QLORA = dict(model="tiny-llama", method="fsdp", gpus=2, precision="bf16-mixed", seq_len=256, batch_size=2,
             lora_rank=8, quant_base="nf4", kbit_upcast=False)


def _replicated_state_bytes(out_f: int, in_f: int) -> int:
    """bitsandbytes NF4 with double quantisation, what one weight keeps besides the packed data: the absmax of each
    64-element block quantised to uint8, its fp32 absmax per 256 of them, the 256-entry fp32 dynamic code, the fp32
    offset and the 16-entry fp32 NF4 code."""
    blocks = -(-out_f * in_f // 64)
    return blocks + -(-blocks // 256) * 4 + 256 * 4 + 4 + 16 * 4


def test_only_the_quantisation_state_stays_on_the_gpu():
    # tiny-llama: 4 layers of q, k, v, o (512 x 512), gate, up (1376 x 512) and down (512 x 1376)
    per_layer = 4 * _replicated_state_bytes(512, 512) + 3 * _replicated_state_bytes(1376, 512)
    got = estimate(user_setup(offload_param=True, **QLORA))
    assert got.components["weights"] == 4 * per_layer == 231_296
    on_gpu = estimate(user_setup(**QLORA))
    assert on_gpu.components["weights"] > got.components["weights"] + 2 * 1024 * 1024   # the packed shards, adapters


def test_the_trace_agrees_within_two_percent():
    s = user_setup(offload_param=True, **QLORA)
    est, real = estimate(s), trace(s, iterations=2)
    for counter in ("peak_allocated_bytes", "peak_reserved_bytes"):
        assert abs(getattr(est, counter) / getattr(real, counter) - 1) < 0.02, counter


def test_torchaos_nf4tensor_is_still_refused():
    with pytest.raises(LlmemError, match="--offload-param with a --qlora-torchao base"):
        estimate(user_setup(**{**QLORA, "quant_base": "torchao-nf4", "precision": "bf16", "kbit_upcast": True},
                            adapter_dtype="base", offload_param=True))
