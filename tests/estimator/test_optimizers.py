"""The optimizers beyond AdamW: Adafactor, Lion, bitsandbytes' 8-bit AdamW (paged and not), optimizer in backward.

Bytes are worked out by hand from the optimizers' sources (torch.optim._adafactor, bitsandbytes 0.50
optim/optimizer.py, lion-pytorch) and checked against the real optimizers where they run on the CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from llmem.errors import LlmemError
from llmem.estimator.engine import estimate
from llmem.estimator.states import model_states
from llmem.model.resolved import resolve
from llmem.runtime.optimizers import EmulatedAdamW8bit, Lion
from llmem.setup.methods import METHODS
from llmem.setup.optimizers import OPTIMIZERS
from llmem.setup.support import check_support
from llmem.setup.training import TrainingSetup

TINY_LLAMA_8BIT_NUMEL = 2 * 32000 * 512 + 4 * (4 * 512 * 512 + 3 * 1376 * 512)   # tensors of >= 1e5 elements


def _setup(optimizer: str, precision: str = "fp32", **kw) -> TrainingSetup:
    return TrainingSetup(model="tiny-llama", optimizer=optimizer, precision=precision, **kw)


def _peak(events) -> int:
    held = peak = 0
    for sign, _tag, size in events:
        held += sign * size
        peak = max(peak, held)
    return peak


# --- Adafactor ----------------------------------------------------------------------------------------------------

def test_adafactor_states_are_factored_row_and_col_second_moments():
    fp32, bf16 = _setup("adafactor"), _setup("adafactor", "bf16")
    assert sum(OPTIMIZERS[fp32.optimizer].states((1376, 512), fp32.param_bytes)) == 4 * (1376 + 512)      # row [m, 1] + col [1, n]
    assert sum(OPTIMIZERS[bf16.optimizer].states((1376, 512), bf16.param_bytes)) == 2 * (1376 + 512)
    assert OPTIMIZERS[fp32.optimizer].states((512,), fp32.param_bytes) == [4 * 512]                       # 1-D: full variance
    assert sum(OPTIMIZERS[fp32.optimizer].states((8, 1376, 512), fp32.param_bytes)) == 4 * 8 * (1376 + 512)   # [.., m, 1] and [.., 1, n]


def test_adafactor_states_match_torch_adafactor():
    """The real torch.optim.Adafactor on CPU tensors: row_var [m, 1], col_var [1, n], variance [n]; the step count
    is a host scalar."""
    w, b = nn.Parameter(torch.randn(24, 40)), nn.Parameter(torch.randn(40))
    opt = torch.optim.Adafactor([w, b], lr=1e-3)
    (w.sum() + b.sum()).backward()
    opt.step()
    sw, sb = opt.state[w], opt.state[b]
    assert tuple(sw["row_var"].shape) == (24, 1) and tuple(sw["col_var"].shape) == (1, 40)
    assert tuple(sb["variance"].shape) == (40,)
    device_bytes = sum(t.nbytes for s in (sw, sb) for k, t in s.items() if k != "step")
    setup = _setup("adafactor")
    assert device_bytes == sum(OPTIMIZERS[setup.optimizer].states((24, 40), setup.param_bytes)) + sum(OPTIMIZERS[setup.optimizer].states((40,), setup.param_bytes))
    assert sw["step"].device.type == "cpu" and sw["step"].dim() == 0


def test_adafactor_forloop_temporaries_by_hand():
    """_single_tensor_adafactor keeps row_mean, col_mean and var_estimate/update as loop locals: the previous
    parameter's update dies only when `update` is rebound, after the next var_estimate exists."""
    setup = _setup("adafactor")
    a, b, c, d = 300, 200, 100, 50
    first = 4 * (a + b + a * b + 1)                        # row, col, var_estimate, row_var.mean [1, 1]
    second = 4 * (c + d + a * b + c * d + 1)               # + the first parameter's update still alive
    assert _peak(OPTIMIZERS[setup.optimizer].step_events([(a, b), (c, d)], setup.param_bytes)) == max(first, second)
    # a vector after a matrix: grad_squared and the clone, with the matrix's update, row and col means alive
    assert _peak(OPTIMIZERS[setup.optimizer].step_events([(a, b), (c,)], setup.param_bytes)) == max(first, 4 * (a + b + a * b + c + c))
    ev = OPTIMIZERS[setup.optimizer].step_events([(a, b), (c, d), (c,)], setup.param_bytes)
    assert sum(sign * size for sign, _t, size in ev) == 0          # everything freed when the function returns


def test_adafactor_runs_on_fake_tensors_and_item_is_restored():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llmem.runtime.patches import fake_scalar_reads

    orig = torch.Tensor.item
    with FakeTensorMode(), fake_scalar_reads():
        w = nn.Parameter(torch.empty(16, 8))
        w.grad = torch.empty(16, 8)
        opt = torch.optim.Adafactor([w], lr=1e-3)
        opt.step()
        assert tuple(opt.state[w]["row_var"].shape) == (16, 1)
    assert torch.Tensor.item is orig
    assert torch.tensor(3.0).item() == 3.0


def test_step_adafactor_reads_fake_scalars_only_while_it_steps():
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    from llmem.runtime.optimizers import make_optimizer

    with FakeTensorMode():
        model = nn.Linear(8, 16)
        model(torch.empty(4, 8)).sum().backward()
        opt = make_optimizer(model, "adafactor")
        opt.step()
        assert tuple(opt.state[model.weight]["col_var"].shape) == (1, 8)
        assert opt.defaults["foreach"] is None            # torch's CUDA default: the for-loop implementation
        with pytest.raises(DataDependentOutputException):  # outside the step: the fake mode's error, as before
            model.weight.sum().item()


def test_adafactor_with_dtensor_methods_is_refused():
    with pytest.raises(LlmemError, match="adafactor"):
        estimate(TrainingSetup(model="tiny-llama", optimizer="adafactor", method="fsdp", gpus=2))
    with pytest.raises(LlmemError, match="adafactor"):
        check_support(TrainingSetup(model="tiny-llama", optimizer="adafactor", method="tp", gpus=2), METHODS["tp"])
    check_support(TrainingSetup(model="tiny-llama", optimizer="adafactor", method="ddp", gpus=2), METHODS["ddp"])


# --- Lion ---------------------------------------------------------------------------------------------------------

def test_lion_state_is_one_copy_of_the_parameters():
    n = 1376 * 512
    assert OPTIMIZERS[_setup("lion").optimizer].states((1376, 512), _setup("lion").param_bytes) == [4 * n]
    assert OPTIMIZERS[_setup("lion", "bf16").optimizer].states((1376, 512), _setup("lion", "bf16").param_bytes) == [2 * n]
    # foreach: the update is one group-sized temporary
    assert _peak(OPTIMIZERS[_setup("lion").optimizer].step_events([(1376, 512), (512,)], _setup("lion").param_bytes)) == 4 * (n + 512)


def test_lion_update_matches_the_reference_by_hand():
    p = nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    opt.state[p]["exp_avg"] = torch.tensor([0.2, 0.2, -1.0])
    p.grad = torch.tensor([-1.0, 0.1, 0.5])
    opt.step()
    # c = 0.9 m + 0.1 g = [0.08, 0.19, -0.85]; p <- p (1 - lr wd) - lr sign(c)
    assert torch.allclose(p.detach(), torch.tensor([1.0 * 0.95 - 0.1, -2.0 * 0.95 - 0.1, 0.5 * 0.95 + 0.1]))
    # m <- 0.99 m + 0.01 g
    assert torch.allclose(opt.state[p]["exp_avg"], torch.tensor([0.198 - 0.01, 0.198 + 0.001, -0.99 + 0.005]))


# --- bitsandbytes 8-bit AdamW -------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [4096, 10_000, 99_999])
def test_adamw_8bit_states_by_hand(n):
    """uint8 state1 + state2 (N bytes each) + fp32 absmax1 + absmax2 (one per block of 256)."""
    expected = 2 * n + 2 * 4 * math.ceil(n / 256)
    assert sum(OPTIMIZERS[_setup("adamw-8bit").optimizer].states((n,), _setup("adamw-8bit").param_bytes)) == expected
    assert sum(OPTIMIZERS[_setup("paged-adamw-8bit", "bf16").optimizer].states((n,), _setup("paged-adamw-8bit", "bf16").param_bytes)) == expected   # < 1e5: not paged
    assert OPTIMIZERS[_setup("paged-adamw-8bit").optimizer].outside_allocator_bytes((n,)) == 0


def test_adamw_8bit_small_parameters_keep_fp32_states_and_paged_ones_leave_the_allocator():
    assert OPTIMIZERS[_setup("adamw-8bit", "bf16").optimizer].states((4095,), _setup("adamw-8bit", "bf16").param_bytes) == [4 * 4095, 4 * 4095]
    n = 1376 * 512
    assert OPTIMIZERS[_setup("paged-adamw-8bit").optimizer].states((1376, 512), _setup("paged-adamw-8bit").param_bytes) == [4 * 2752, 4 * 2752]   # absmax only
    assert OPTIMIZERS[_setup("paged-adamw-8bit").optimizer].outside_allocator_bytes((1376, 512)) == 2 * n
    # the two 256-entry fp32 quantisation maps, shared by every 8-bit parameter
    assert OPTIMIZERS[_setup("adamw-8bit").optimizer].shared_state_bytes([(1376, 512), (512, 512), (512,)], _setup("adamw-8bit").optimizer_in_backward) == 2 * 256 * 4
    assert OPTIMIZERS[_setup("adamw-8bit").optimizer].shared_state_bytes([(512,)], _setup("adamw-8bit").optimizer_in_backward) == 0


def test_emulated_8bit_optimizer_allocates_bnb_state_tensors():
    """bitsandbytes Optimizer2State.init_state: state1/state2 uint8 of the parameter's shape, qmap1/qmap2 the shared
    signed/unsigned dynamic maps (256 fp32), absmax1/absmax2 fp32 [ceil(n / 256)]; under 4096 elements fp32
    state1/state2 only."""
    big, small = nn.Parameter(torch.randn(100, 100)), nn.Parameter(torch.randn(10, 10))
    other = nn.Parameter(torch.randn(64, 64))
    opt = EmulatedAdamW8bit([big, small, other], lr=1e-3)
    for p in (big, small, other):
        p.grad = torch.ones_like(p)
    before = big.detach().clone()
    opt.step()
    s = opt.state[big]
    assert s["state1"].dtype == torch.uint8 and s["state1"].shape == big.shape
    assert s["state2"].dtype == torch.uint8 and s["state2"].shape == big.shape
    assert s["absmax1"].dtype == torch.float32 and tuple(s["absmax1"].shape) == (40,)   # ceil(10000 / 256)
    assert tuple(s["absmax2"].shape) == (40,)
    assert s["qmap1"].dtype == torch.float32 and tuple(s["qmap1"].shape) == (256,)
    assert s["qmap1"] is opt.state[other]["qmap1"] and s["qmap2"] is opt.state[other]["qmap2"]
    assert s["step"] == 1
    t = opt.state[small]
    assert set(t) == {"step", "state1", "state2"} and t["state1"].dtype == torch.float32
    assert not torch.equal(big.detach(), before)          # updated in place
    assert opt.outside_allocator_bytes == 0


def test_emulated_paged_8bit_keeps_large_states_outside_the_allocator():
    big, mid = nn.Parameter(torch.randn(400, 300)), nn.Parameter(torch.randn(100, 100))
    opt = EmulatedAdamW8bit([big, mid], lr=1e-3, paged=True)
    big.grad, mid.grad = torch.ones_like(big), torch.ones_like(mid)
    opt.step()
    assert opt.state[big]["state1"].device.type == "meta"       # managed memory: no allocator event
    assert opt.state[big]["absmax1"].device.type == "cpu"       # absmax: torch.zeros on the device
    assert opt.state[mid]["state1"].device.type == "cpu"        # < 1e5 elements: a regular buffer
    assert opt.outside_allocator_bytes == 2 * 400 * 300


def test_paged_states_counted_in_device_used_not_in_the_allocator():
    setup = TrainingSetup(model="tiny-llama", optimizer="paged-adamw-8bit", batch_size=1, seq_len=64)
    res = estimate(setup)
    assert res.components["managed_memory"] == 2 * TINY_LLAMA_8BIT_NUMEL
    assert res.device_used_bytes == res.peak_reserved_bytes + res.components["cuda_context"] \
        + 2 * TINY_LLAMA_8BIT_NUMEL
    assert any("cudaMallocManaged" in n for n in res.notes)
    plain = estimate(TrainingSetup(model="tiny-llama", optimizer="adamw-8bit", batch_size=1, seq_len=64))
    assert plain.components["managed_memory"] == 0


@pytest.mark.parametrize("method", ["fsdp", "tp"])
def test_8bit_with_dtensor_methods_is_refused(method):
    with pytest.raises(LlmemError, match="8bit"):
        estimate(TrainingSetup(model="tiny-llama", optimizer="adamw-8bit", method=method, gpus=2))


def test_trace_notes_say_the_8bit_optimizer_is_emulated():
    from llmem.runtime.trace import trace

    res = trace(TrainingSetup(model="tiny-llama", optimizer="paged-adamw-8bit", batch_size=1, seq_len=16))
    assert any("emulation" in n for n in res.notes)
    assert res.components["managed_memory"] == 2 * TINY_LLAMA_8BIT_NUMEL
    assert res.device_used_bytes == res.peak_reserved_bytes + res.components["cuda_context"] \
        + 2 * TINY_LLAMA_8BIT_NUMEL


# --- optimizer in backward ----------------------------------------------------------------------------------------

def test_in_backward_real_hooks_step_and_free_each_gradient():
    """The real mechanism: each post-accumulate-grad hook steps its own optimizer and frees the gradient, so at any
    hook at most one gradient exists; states appear lazily."""
    from llmem.runtime.optimizers import InBackwardOptimizer

    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    live_at_hook: list[int] = []
    for p in model.parameters():   # registered first: runs just before the optimizer's hook
        p.register_post_accumulate_grad_hook(
            lambda _p: live_at_hook.append(sum(q.grad is not None for q in model.parameters())))
    opt = InBackwardOptimizer(model, "adamw")
    assert not opt.state
    model(torch.randn(5, 8)).sum().backward()
    assert live_at_hook == [1, 1, 1, 1]
    assert all(p.grad is None for p in model.parameters())
    assert len(opt.state) == 4 and all("exp_avg" in s for s in opt.state.values())


def test_in_backward_schedule_holds_the_largest_gradient_not_the_sum():
    from llmem.estimator.schedule import StepSchedule
    from llmem.memory.activations.profile import activation_profile
    from llmem.model.anatomy import load_anatomy

    anatomy = load_anatomy("tiny-llama")
    largest = 32000 * 512 * 4                   # fp32 embedding / lm_head gradient
    total = sum(p.numel for p in anatomy.params) * 4
    for in_backward, expected in ((True, largest), (False, total)):
        setup = TrainingSetup(model="tiny-llama", precision="fp32", batch_size=1, seq_len=64,
                              optimizer_in_backward=in_backward)
        act = activation_profile(resolve(setup))
        sch = StepSchedule(resolve(setup), act).build()
        held = peak = 0
        for sign, _k, size, _s, comp in sch.events:
            if comp == "gradients":
                held += sign * size
                peak = max(peak, held)
        assert peak == expected


def test_in_backward_model_states_and_validation():

    ms = model_states(resolve(_setup("adamw", optimizer_in_backward=True)))
    assert ms.optimizer_temporaries == 32000 * 512 * 4       # foreach sqrt of the largest single parameter
    with pytest.raises(LlmemError, match="single"):
        estimate(TrainingSetup(model="tiny-llama", optimizer_in_backward=True, method="ddp", gpus=2))
    with pytest.raises(LlmemError, match="single"):   # the trace refuses it before building anything
        from llmem.runtime.trace import trace

        trace(TrainingSetup(model="tiny-llama", optimizer_in_backward=True, method="fsdp", gpus=2))


@pytest.mark.parametrize("model", ["tiny-llama", "gpt2"])     # untied and tied embeddings
def test_in_backward_moments_follow_the_replay(model):
    """The planner's quick search takes the largest moment: with the optimizer in backward it must follow the
    replayed schedule (no gradient sum, no optimizer-step moment)."""
    from llmem.estimator.engine import quick_peak_allocated
    from llmem.model.anatomy import load_anatomy
    from llmem.setup.gpus import resolve_gpu

    setup = TrainingSetup(model=model, precision="bf16-mixed", batch_size=1, seq_len=64, optimizer_in_backward=True)
    res = estimate(setup)
    quick = quick_peak_allocated(resolve(setup, load_anatomy(model), resolve_gpu(setup.gpu)))
    assert abs(quick - res.peak_allocated_bytes) <= 0.02 * res.peak_allocated_bytes
    assert "optimizer_step" not in {m["phase"] for m in res.moments}


@pytest.mark.parametrize(("model", "kw"), [
    ("tiny-llama", {}),
    ("tiny-llama", {"precision": "bf16-mixed", "seq_len": 64}),
    ("tiny-llama", {"grad_ckpt": True}),
    ("gpt2", {"seq_len": 128}),                                  # tied: the head's hook waits for the embedding
    ("tiny-qwen3", {"precision": "bf16-mixed", "batch_size": 2, "seq_len": 256}),
])
def test_in_backward_with_offloaded_activations_no_negative_component(model, kw):
    """--optimizer-in-backward --offload-activations: no moment holds a negative byte count."""
    res = estimate(TrainingSetup(model=model, optimizer_in_backward=True, offload_activations=True, **kw))
    negative = [(i, k, v) for i, m in enumerate(res.moments) for k, v in m["components"].items() if v < 0]
    assert negative == []


def test_in_backward_head_hook_frees_the_offloaded_head_input():
    """tiny-llama (untied, pure bf16, batch 1 x 1024 tokens) with activations offloaded: the only saved tensor left
    on the device at the loss is the lm_head's input, [1024, 512] bf16 (the output layer is not offloaded); once the
    lm_head's hook has stepped it, that input is freed too, so the moment holds no activations, not minus the final
    norm's offloaded tensors."""
    res = estimate(TrainingSetup(model="tiny-llama", optimizer_in_backward=True, offload_activations=True,
                                 precision="bf16", batch_size=1, seq_len=1024))
    loss_backward, head_hook = res.moments[1]["components"], res.moments[2]["components"]
    assert loss_backward["activations"] == 1024 * 512 * 2
    assert head_hook["gradients"] >= 32000 * 512 * 2          # the lm_head's gradient, its step's temporaries
    assert head_hook["activations"] == 0


def test_cli_options():
    from llmem.cli import build_parser
    from llmem.cli.options import setup_from_args

    args = build_parser().parse_args(["estimate", "tiny-llama", "--optimizer", "lion", "--optimizer-in-backward"])
    setup = setup_from_args(args)
    assert setup.optimizer == "lion" and setup.optimizer_in_backward
    assert setup.to_dict()["optimizer_in_backward"] is True
    with pytest.raises(LlmemError, match="paged-adamw-8bit"):
        TrainingSetup(model="tiny-llama", optimizer="adam8")


def test_cli_refuses_unsupported_combinations_with_exit_2(capsys):
    from llmem.cli import main

    assert main(["estimate", "tiny-llama", "--optimizer-in-backward", "--gpus", "2"]) == 2
    assert "--optimizer-in-backward" in capsys.readouterr().err
    assert main(["estimate", "tiny-llama", "--optimizer", "adafactor", "--method", "fsdp", "--gpus", "2"]) == 2
    assert main(["estimate", "tiny-llama", "--optimizer", "adam-9bit"]) == 2


# ---------------------------------------------------------------------------------------------- Muon

def test_muon_row_is_muon_for_the_hidden_matrices_and_adamw_for_the_rest():
    """tiny-llama fp32: Muon keeps one momentum buffer per decoder-layer matrix (4 layers x (4 x 512 x 512 +
    3 x 512 x 1376) = 12,648,448 elements), AdamW two states for the rest (embedding and lm_head 2 x 32000 x 512, the
    9 norms of 512): 4 B each."""
    ms = model_states(resolve(_setup("muon")))
    matrices = 4 * (4 * 512 * 512 + 3 * 512 * 1376)
    others = 2 * 32000 * 512 + 9 * 512
    assert matrices == 12_648_448 and others == 32_772_608
    assert ms.optimizer_states == 4 * matrices + 8 * others
    muon, adamw = OPTIMIZERS["muon"].parts
    assert (muon.name, adamw.name) == ("muon-matrices", "adamw")


def test_muon_newton_schulz_temporaries_by_hand():
    """One [4, 6] parameter: the gradient's copy U (24 x pb), its bf16 copy X0 (48 B, none when the gradient is
    bf16), then per iteration gram and gram_update [4, 4] bf16 (32 B each) and the new X (48 B) while the previous X
    is still referenced: the peak is U + gram + gram_update + two X."""
    muon = OPTIMIZERS["muon"].parts[0]
    assert _peak(muon.step_events([(4, 6)], 4)) == 96 + 2 * 32 + 2 * 48
    assert _peak(muon.step_events([(6, 4)], 4)) == 96 + 2 * 32 + 2 * 48        # transposed: the same sizes
    assert _peak(muon.step_events([(4, 6)], 2)) == 48 + 2 * 32 + 2 * 48        # bf16: X0 is U itself
    # the previous parameter's update lives until the next one's copy exists: 48 B under a second [4, 6] copy
    assert _peak(muon.step_events([(4, 6), (2, 2)], 4)) == _peak(muon.step_events([(4, 6)], 4))
    ev = muon.step_events([(4, 6), (4, 6)], 4)
    held = [0]
    for sign, _t, size in ev:
        held.append(held[-1] + sign * size)
    assert held[-1] == 0 and sum(1 for s, _t, n in ev if s > 0 and n == 16 * 2) == 2 * 2 * 5


def test_muon_on_fsdp2_shards_gathers_as_dtensor_places_it():
    """A [4, 8] matrix on 2 shards (local [2, 8], fp32 gradient): gram = X @ X.T makes X.T (a Shard(1) view)
    contiguous (32 B), all-gathers it (64 B), waits (64 B) and concatenates (64 B); gram is Shard(0) [2, 4] (16 B).
    The peak is at the second iteration's gram: U 64 + the previous gram and gram_update 2 x 16 + X 32 + the four
    tensors of the gather 32 + 3 x 64."""
    muon = OPTIMIZERS["muon"].parts[0]
    assert _peak(muon.step_events([(2, 8)], 4, 2)) == 64 + 2 * 16 + 32 + 32 + 3 * 64


def test_muon_is_refused_with_tensor_parallelism():
    with pytest.raises(LlmemError, match="muon with tp"):
        estimate(TrainingSetup(model="tiny-llama", optimizer="muon", method="tp", gpus=2))
    check_support(TrainingSetup(model="tiny-llama", optimizer="muon", method="fsdp", gpus=2), METHODS["fsdp"])


@pytest.mark.parametrize("kw", [{}, {"method": "fsdp", "gpus": 2}, {"optimizer_in_backward": True}])
def test_muon_estimate_matches_the_trace(kw):
    """torch.optim.Muon and AdamW run for real on fake tensors (FSDP2's DTensor shards included)."""
    from llmem.runtime.trace import trace

    setup = TrainingSetup(model="tiny-llama", optimizer="muon", precision="bf16-mixed", batch_size=1, seq_len=64,
                          gpu="H100-80GB", **kw)
    est, truth = estimate(setup), trace(setup)
    for counter in ("peak_allocated_bytes", "peak_reserved_bytes"):
        assert abs(getattr(est, counter) - getattr(truth, counter)) <= 0.01 * getattr(truth, counter), counter
