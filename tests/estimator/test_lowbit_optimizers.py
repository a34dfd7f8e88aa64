"""torchao's low-bit AdamW (8-bit, 4-bit, fp8) and bitsandbytes' paged 32-bit AdamW.

State bytes are worked out by hand from torchao 0.18.0's optim/adam.py and subclass_{8bit,4bit,fp8}.py (per state:
codes, one fp32 scale per block, the 8-/4-bit formats' own fp32 qmap; quantised when the local tensor has >= 4096
elements and a multiple of the block size, else zeros_like in the parameter's dtype) and bitsandbytes 0.50's
Optimizer2State (optim_bits=32: fp32 state1/state2, cudaMallocManaged from 1e5 elements).

tiny-llama (vocab 32000, hidden 512, 4 layers, MLP 1376, untied head): 30 matrices of >= 4096 elements, all multiples
of 256 (embedding and head 32000 x 512, four 512 x 512 attention projections and three 1376 x 512 MLP matrices per
layer) and 9 norms of 512 elements (fp32 under bf16-mixed: 2 x 512 x 4 bytes of states each).
"""

from __future__ import annotations

import pytest
import torch

from llmem.errors import LlmemError
from llmem.estimator.engine import estimate
from llmem.runtime.optimizers import EmulatedTorchaoAdamW
from llmem.setup.optimizers import OPTIMIZERS, TORCHAO_FORMATS
from llmem.setup.training import TrainingSetup

MATRICES = 30
N = 2 * 32000 * 512 + 4 * (4 * 512 * 512 + 3 * 1376 * 512)    # 45_416_448 elements in the 30 matrices
NORM_STATES = 9 * 2 * 512 * 4                                  # 36_864 bytes
TORCHAO = ("torchao-adamw-8bit", "torchao-adamw-4bit", "torchao-adamw-4bit-b256", "torchao-adamw-fp8")


def _setup(optimizer: str, **kw) -> TrainingSetup:
    base = {"model": "tiny-llama", "precision": "bf16-mixed", "batch_size": 1, "seq_len": 64, "gpu": "H100-80GB"}
    return TrainingSetup(optimizer=optimizer, **{**base, **kw})


# per matrix of n elements, both states: codes + scales (+ qmaps)
HAND_STATES = {
    # uint8 codes n, fp32 scale n / 256, 256-entry fp32 qmap: 2 (n + n / 64 + 1024)
    "torchao-adamw-8bit": 2 * N + N // 32 + MATRICES * 2 * 1024 + NORM_STATES,           # 92_350_464
    # packed codes n / 2, fp32 scale n / 128, 16-entry qmap: 2 (n / 2 + n / 32 + 64)
    "torchao-adamw-4bit": N + N // 16 + MATRICES * 2 * 64 + NORM_STATES,                 # 48_295_680
    # the same with 256-element blocks (transformers' adamw_torch_4bit)
    "torchao-adamw-4bit-b256": N + N // 32 + MATRICES * 2 * 64 + NORM_STATES,            # 46_876_416
    # float8 codes n, fp32 scale n / 256, no qmap
    "torchao-adamw-fp8": 2 * N + N // 32 + NORM_STATES,                                  # 92_289_024
}


@pytest.mark.parametrize("name", TORCHAO)
def test_torchao_states_of_tiny_llama_by_hand(name):
    assert estimate(_setup(name)).components["optimizer_states"] == HAND_STATES[name]


@pytest.mark.parametrize("shape, pb, expected", [
    ((4095,), 4, {"8": [4 * 4095] * 2, "4": [4 * 4095] * 2, "f": [4 * 4095] * 2}),     # under 4096: zeros_like
    ((4096,), 2, {"8": [4096, 64, 1024] * 2, "4": [2048, 128, 64] * 2, "f": [4096, 64] * 2}),
    # 4224 = 33 x 128: a multiple of AdamW4bit's block, not of the 256-element ones (kept in bf16 there)
    ((33, 128), 2, {"8": [2 * 4224] * 2, "4": [2112, 132, 64] * 2, "f": [2 * 4224] * 2}),
])
def test_torchao_quantises_only_big_block_multiples(shape, pb, expected):
    rows = {"8": "torchao-adamw-8bit", "4": "torchao-adamw-4bit", "f": "torchao-adamw-fp8"}
    for key, name in rows.items():
        assert OPTIMIZERS[name].states(shape, pb) == expected[key], name


def test_emulation_makes_torchaos_state_tensors():
    """What torchao 0.18's AdamW8bit / AdamW4bit / AdamWFp8 hold for a [64, 128] bf16 parameter and a [100] one
    (read by running them on the CPU): OptimState8bit codes uint8 (64, 128), scale (32,), qmap (256,);
    OptimState4bit codes (4096,), scale (64,), qmap (16,); OptimStateFp8 codes float8_e4m3fn (64, 128), scale
    (32,); the [100] parameter's states bf16 (100,)."""
    want = {"torchao-adamw-8bit": (torch.uint8, (64, 128), (32,), (256,)),
            "torchao-adamw-4bit": (torch.uint8, (4096,), (64,), (16,)),
            "torchao-adamw-fp8": (torch.float8_e4m3fn, (64, 128), (32,), None)}
    for name, (dtype, codes, scale, qmap) in want.items():
        p = torch.nn.Parameter(torch.randn(64, 128, dtype=torch.bfloat16))
        q = torch.nn.Parameter(torch.randn(100, dtype=torch.bfloat16))
        opt = EmulatedTorchaoAdamW([p, q], TORCHAO_FORMATS[name])
        p.grad, q.grad = torch.randn_like(p), torch.randn_like(q)
        opt.step()
        for state in ("exp_avg", "exp_avg_sq"):
            st = opt.state[p]
            assert (st[f"{state}.codes"].dtype, tuple(st[f"{state}.codes"].shape)) == (dtype, codes)
            assert tuple(st[f"{state}.scale"].shape) == scale and st[f"{state}.scale"].dtype == torch.float32
            assert (tuple(st[f"{state}.qmap"].shape) if qmap else f"{state}.qmap" not in st) == (qmap or True)
            assert opt.state[q][state].dtype == torch.bfloat16 and tuple(opt.state[q][state].shape) == (100,)


def test_paged_32bit_keeps_big_states_in_managed_memory():
    """Every matrix has >= 1e5 elements: its fp32 state1/state2 (8 bytes per element) are managed memory; the
    norms' fp32 states stay in the caching allocator."""
    est = estimate(_setup("paged-adamw-32bit"))
    assert est.components["optimizer_states"] == NORM_STATES
    assert est.components["managed_memory"] == 8 * N == 363_331_584
    assert OPTIMIZERS["paged-adamw-32bit"].states((99_999,), 2) == [4 * 99_999] * 2


@pytest.mark.parametrize("name, kw", [(n, {}) for n in (*TORCHAO, "paged-adamw-32bit")]
                         + [(n, {"method": "fsdp", "gpus": 2}) for n in TORCHAO]
                         + [("torchao-adamw-8bit", {"method": "ddp", "gpus": 2}),
                            ("torchao-adamw-4bit", {"optimizer_in_backward": True})])
def test_estimate_matches_the_trace(name, kw):
    from llmem.runtime.trace import trace

    setup = _setup(name, **kw)
    est, truth = estimate(setup), trace(setup)
    for counter in ("peak_allocated_bytes", "peak_reserved_bytes"):
        assert abs(getattr(est, counter) - getattr(truth, counter)) <= 0.02 * getattr(truth, counter), counter


def test_fsdp2_shards_are_quantised_per_rank():
    """fsdp over 2: each rank quantises its half of every matrix (N / 2 elements, still multiples of 256); the
    norms' 256-element shards keep fp32 states."""
    est = estimate(_setup("torchao-adamw-8bit", method="fsdp", gpus=2))
    assert est.components["optimizer_states"] == N + N // 64 + MATRICES * 2 * 1024 + NORM_STATES // 2


@pytest.mark.parametrize("name, method, gpus, match", [
    ("torchao-adamw-8bit", "tp", 2, "tensor-parallel"),
    ("torchao-adamw-fp8", "ds-zero2", 2, "flat fp32 partition"),
    ("paged-adamw-32bit", "fsdp", 2, "single and ddp only"),
])
def test_refused_where_not_modelled(name, method, gpus, match):
    with pytest.raises(LlmemError, match=match):
        estimate(_setup(name, method=method, gpus=gpus))


def test_cli_help_lists_the_rows(capsys):
    from llmem.cli import main

    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name in (*TORCHAO, "paged-adamw-32bit"):
        assert name in out
