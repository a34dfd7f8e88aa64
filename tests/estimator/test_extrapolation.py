"""Deep models' estimates (llmem.estimator.engine.replayed_step): extrapolated from two shallow replays only while the
step keeps its shape, and the no-grad forward of a checkpointed layer under sequence parallel."""

from __future__ import annotations

from llmem.estimator.engine import EXTRAPOLATE_FROM, estimate, step_schedule
from llmem.estimator.events import PhasePeak, Replay, replay, same_peak_phase
from llmem.memory.activations.profile import activation_profile
from llmem.model.resolved import resolve
from llmem.setup.training import TrainingSetup


def _replay(phase: str) -> Replay:
    return Replay(10, 12, {}, phase, {f"it0:{phase}": PhasePeak(10, 12, {})})


def test_a_peak_phase_that_switches_with_depth_is_seen():
    """Both shallow replays peak in backward; at full depth the optimizer step does: not the same step."""
    assert same_peak_phase(_replay("backward"), _replay("backward"), _replay("backward"))
    assert not same_peak_phase(_replay("backward"), _replay("backward"), _replay("optimizer_step"))


def test_optimizer_step_overtaking_backward_at_depth_is_replayed_whole():
    """Qwen2.5-14B (48 layers) under FSDP 4, 2 x 4096, checkpointed: at 16 and 24 layers the step peaks in
    backward, at 48 in the optimizer step (AdamW's states and foreach temporaries grow faster a layer). The estimate
    is the whole-depth replay's (the extrapolation from 16 and 24 layers says 14 % less reserved)."""
    setup = TrainingSetup(model="Qwen/Qwen2.5-14B", method="fsdp", gpus=4, gpu="H100-80GB", precision="bf16-mixed",
                          batch_size=2, seq_len=4096, grad_ckpt=True)
    r = resolve(setup)
    act = activation_profile(r)
    assert r.anatomy.num_layers == 48
    shallow = [replay(step_schedule(r, act, n).build()).peak_phase for n in EXTRAPOLATE_FROM]
    whole = replay(step_schedule(r, act).build())
    assert shallow == ["backward", "backward"] and whole.peak_phase == "optimizer_step"
    est = estimate(setup)
    assert (est.peak_allocated_bytes, est.peak_reserved_bytes, est.peak_phase) == \
        (whole.peak_allocated_bytes, whole.peak_reserved_bytes, "optimizer_step")


def test_sequence_parallel_gathered_input_dies_once_read_in_a_checkpointed_forward():
    """tiny-llama (h 512), TP 4 with SequenceParallel, pure bf16, 2 x 256 tokens, checkpointed: PrepareModuleInput
    all-gathers each norm's sequence shard (128 tokens) to a [512, 512] bf16 tensor (524,288 B) through two gather
    buffers of the same size. Under the checkpoint's no_grad forward the q/k/v linears' gathered input dies once
    they have read it, so at most three such tensors live at once in iteration 0's decoder layers (the MLP's gather
    buffers and gathered input), not four (the attention's gathered input kept to the layer's end). Nothing else in
    the layers has that size (the norms' fp32 shard: 262,144 B; attention's [512, 128]: 131,072 B; the MLP's
    [512, 344]: 352,256 B)."""
    setup = TrainingSetup(model="tiny-llama", method="tp", gpus=4, gpu="H100-80GB", precision="bf16",
                          optimizer="sgd", batch_size=2, seq_len=256, grad_ckpt=True, sequence_parallel=True)
    r = resolve(setup)
    sch = step_schedule(r, activation_profile(r)).build()
    gathered = 2 * 256 * 512 * 2
    head = next(i for i, where in sch.marks if where == "lm_head and loss")   # the layers end there
    live, most = set(), 0
    for sign, key, size, _stream, comp in sch.events[:head]:
        if size == gathered and comp == "activations":
            live.add(key) if sign > 0 else live.discard(key)
            most = max(most, len(live))
    assert most == 3
