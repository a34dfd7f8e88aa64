"""A vision-language step's estimate (Qwen2.5-VL's architecture): its batch, its residual stream when the language
model is frozen, the rule that checkpointing hooks the frozen encoder, and what is refused. The estimate against
the trace is the CI matrix's (tests/validate/test_validate.py: each part frozen, LoRA, checkpointing)."""

from __future__ import annotations

import pytest

from llmem.cli import main
from llmem.learn.shallow_copy import learned_activations
from llmem.memory.activations.learned import LEARN_ENV
from llmem.memory.activations.learned_vision import Op
from llmem.memory.activations.profile import vision_batch_bytes
from llmem.model.anatomy import load_anatomy
from llmem.model.resolved import resolve
from llmem.setup.methods import method_spec
from llmem.setup.precision import regime_for
from llmem.setup.training import TrainingSetup

TINY = dict(model="tiny-qwen2_5_vl", images_per_sample=1, image_size="448x448", batch_size=4, seq_len=64)


def test_the_batch_is_the_collated_inputs():
    """448x448 -> 32x32 patches of 14 px (1,024), 256 visual tokens: the language model runs 64 + 256 tokens.
    ids [4, 320] int64, pixel_values [4 x 1024, 3 x 2 x 14 x 14] fp32, 3-D positions [3, 4, 320] int64."""
    setup = TrainingSetup(**TINY)
    assert vision_batch_bytes(load_anatomy(setup.model), setup) == (4 * 320 * 8, 4 * 1024 * 1176 * 4,
                                                                      3 * 4 * 320 * 8)
    assert vision_batch_bytes(load_anatomy("tiny-llama"), TrainingSetup("tiny-llama")) == ()


def test_a_frozen_language_model_streams_in_the_compute_dtype():
    """--freeze-language-model keeps the frozen token embedding in bf16 (as LoRA's base): its output, the residual
    stream, is bf16 under autocast; trained, it is the fp32 master weight's."""
    spec = method_spec("single")
    assert regime_for(TrainingSetup(**TINY), spec).res == 4
    assert regime_for(TrainingSetup(**TINY, freeze_language_model=True), spec).res == 2


@pytest.mark.parametrize(("fields", "keeps", "backward"), [
    ({"lora_rank": 8}, False, False),                     # the frozen encoder runs without a graph
    ({"lora_rank": 8, "grad_ckpt": True}, True, True),    # checkpointing hooks its patch embedding's output
    ({"freeze_vision_tower": True}, True, True),          # the trained merger keeps its inputs
])
def test_what_the_encoder_keeps_follows_autograd(fields, keeps, backward, monkeypatch):
    """transformers' checkpointing calls enable_input_require_grads, which hooks every input embedding, the vision
    encoder's patch embedding too: under --grad-ckpt a frozen encoder keeps its blocks' inputs and runs a backward
    (no gradient of its own)."""
    monkeypatch.setenv(LEARN_ENV, "auto")
    learned = learned_activations(resolve(TrainingSetup(**TINY, **fields)))
    side = learned.vision
    assert any(op[0] == Op.KEEP for op in side.forward) is keeps
    assert bool(side.backward) is backward
    grads = {op[4] for op in side.backward if op[0] == Op.GRAD}
    assert grads == ({"model.visual.merger.mlp.0.weight", "model.visual.merger.mlp.0.bias",
                      "model.visual.merger.mlp.2.weight", "model.visual.merger.mlp.2.bias",
                      "model.visual.merger.ln_q.weight"} if "freeze_vision_tower" in fields else set())


@pytest.mark.parametrize(("command", "says"), [
    (["estimate", "--engine", "paper"], "--engine paper with images"),
])
def test_what_is_not_wired_is_one_line(command, says, capsys):
    args = ["tiny-qwen2_5_vl", "--images-per-sample", "1", "--image-size", "448x448", "--seq-len", "64"]
    assert main([*command, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmem: error: ") and err.count("\n") == 1 and says in err, err


GEMMA = dict(model="tiny-gemma3", images_per_sample=1, image_size="448x448", batch_size=4, seq_len=64)


def test_gemma3s_projector_beside_the_tower_makes_its_gradients(monkeypatch):
    """Gemma 3's projector is its own module beside the vision tower: with the tower frozen, the vision side's
    backward makes the projector's two gradients (its norm's weight and its projection matrix), read from the same
    run; trained whole, every parameter of the tower too (SigLIP: 16 in each of its 4 blocks; the patch embedding's weight
    and bias, the position embedding, the final LayerNorm's weight and bias)."""
    monkeypatch.setenv(LEARN_ENV, "auto")
    frozen = learned_activations(resolve(TrainingSetup(**GEMMA, freeze_vision_tower=True))).vision
    assert {op[4] for op in frozen.backward if op[0] == Op.GRAD} == {
        "model.multi_modal_projector.mm_input_projection_weight", "model.multi_modal_projector.mm_soft_emb_norm.weight"}
    whole = learned_activations(resolve(TrainingSetup(**GEMMA))).vision
    grads = [op[4] for op in whole.backward if op[0] == Op.GRAD]
    assert len(grads) == len(set(grads)) == 2 + 4 * 16 + 5


def test_gemma3s_tied_embedding_backward_is_the_schedules(monkeypatch):
    """The token embedding's backward (its scale's gradient, then the tied weight's new gradient [16000, 256] fp32
    summed into the lm_head's) is not read into the vision side: the schedule makes it (llmem.estimator.schedule
    .gradients.accumulate). The vision side ends with the tower's first gradients (its patch embedding's)."""
    monkeypatch.setenv(LEARN_ENV, "auto")
    side = learned_activations(resolve(TrainingSetup(**GEMMA))).vision
    assert 16_000 * 256 * 4 not in {op[3] for op in side.backward if op[0] == Op.TEMP}
    last_grad = max(i for i, op in enumerate(side.backward) if op[0] == Op.GRAD)
    assert side.backward[last_grad][4].startswith("model.vision_tower.embeddings.patch_embedding.")
    assert all(op[0] != Op.TEMP for op in side.backward[last_grad + 1:])


def test_gemma3s_masks_are_the_models():
    """The full and the sliding mask Gemma 3 builds from token_type_ids, bool [4, 1, 80, 80] each: by hand 2 x 25,600
    bytes, and in the real step (the learned copy's run) the tensors the model's own ops make before the first decoder
    layer and free at the end of the forward, live across every decoder layer."""
    from llmem.learn.one_point import run_point
    from llmem.learn.points import FORWARD
    from llmem.memory.activations.profile import vision_mask_bytes

    setup = TrainingSetup(**GEMMA)
    assert vision_mask_bytes(load_anatomy(setup.model), setup) == 2 * 4 * 80 * 80
    events = run_point(setup).vision.events
    layer0 = next(i for i, e in enumerate(events) if e[0] and e[5].startswith("model.language_model.layers.0"))
    last = max(i for i, e in enumerate(events) if e[3] == FORWARD and e[5].startswith("model.language_model.layers"))
    born = {e[1]: (i, e[2]) for i, e in enumerate(events[:layer0]) if e[0] and e[5] == "model"}
    across = [born[e[1]][1] for i, e in enumerate(events) if not e[0] and e[1] in born and i > last
              and e[3] == FORWARD]
    # beside them one [4, 80] int64 (the image blocks' ids the sliding mask reads), 8 bytes a token, not laid out
    assert sorted(across) == [4 * 80 * 8, 4 * 80 * 80, 4 * 80 * 80]


QWEN3 = dict(model="tiny-qwen3_vl", images_per_sample=1, image_size="448x448", batch_size=4, seq_len=64)
_MERGER = {f"model.visual.merger.{m}.{p}" for m in ("norm", "linear_fc1", "linear_fc2") for p in ("weight", "bias")}


@pytest.mark.parametrize(("fields", "merger", "deepstack"), [
    ({"freeze_vision_tower": True}, True, False),      # the deepstack mergers are the tower's (LLaMA-Factory's keys)
    ({"freeze_projector": True}, False, True),
    ({}, True, True),
])
def test_qwen3s_deepstack_mergers_make_their_gradients(fields, merger, deepstack, monkeypatch):
    """Qwen3-VL's vision side, read from the copy's real backward: the merger's gradients (its LayerNorm and two
    linears) and the deepstack mergers' (the same six each), as each part is frozen. The copy's 2 decoder layers take
    the first 2 of the 3 deepstack features (Qwen3VLTextModel.forward: feature k after layer k): the third merger's
    output reaches no loss there, so its gradients are not in the copy's backward (the schedule makes them: below)."""
    monkeypatch.setenv(LEARN_ENV, "auto")
    side = learned_activations(resolve(TrainingSetup(**QWEN3, **fields))).vision
    grads = {op[4] for op in side.backward if op[0] == Op.GRAD}
    assert (_MERGER <= grads) is merger
    deep = {g.split(".")[3] for g in grads if g.startswith("model.visual.deepstack_merger_list.")}
    assert deep == ({"0", "1"} if deepstack else set())


def test_qwen3s_last_deepstack_mergers_gradients_are_made(monkeypatch):
    """The third deepstack merger's gradients (6 parameters, 2 x 512 + 512 x 512 + 512 + 512 x 512 + 512 fp32 at the
    tiny shape, about 1 MiB), which the copy's backward never makes, are made by the schedule at the vision side's
    end: at one sample, 16 text tokens and one 224x224 image the peak is the optimizer step's, where every gradient is
    live, and the estimate equals the trace's (without them it is 0.3 % under)."""
    from llmem.estimator.engine import estimate
    from llmem.runtime.trace import trace

    monkeypatch.setenv(LEARN_ENV, "auto")
    setup = TrainingSetup("tiny-qwen3_vl", images_per_sample=1, image_size="224x224", batch_size=1, seq_len=16,
                          precision="bf16-mixed", gpu="H100-80GB")
    est, truth = estimate(setup).peak_allocated_bytes, trace(setup).peak_allocated_bytes
    assert abs(est - truth) <= 0.001 * truth


def test_qwen3s_deepstack_layers_keep_their_input(monkeypatch):
    """Qwen3-VL adds the deepstack features to the hidden states after each of its first layers (a clone of the
    layer's output, the image rows indexed and put back: Qwen3VLTextModel._deepstack_process), between the decoder
    layers: the clone is the next layer's input, kept by it as a plain layer's input is. At 4 x 256 tokens and two
    896x672 images a sample (1,176 visual tokens) the estimate's peak is the trace's within 0.5 %."""
    from llmem.estimator.engine import estimate
    from llmem.runtime.trace import trace

    monkeypatch.setenv(LEARN_ENV, "auto")
    setup = TrainingSetup("tiny-qwen3_vl", images_per_sample=2, image_size="896x672", batch_size=4, seq_len=256,
                          precision="bf16-mixed", gpu="H100-80GB")
    est, truth = estimate(setup).peak_allocated_bytes, trace(setup).peak_allocated_bytes
    assert abs(est - truth) <= 0.005 * truth
