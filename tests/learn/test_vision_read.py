"""Reading a vision-language step's vision side (llmem.learn.vision_read) from a hand-written step: which tensors a
piece keeps, the temporaries between them, the workspace, and the backward after the last decoder layer's, each
event placed by hand."""

from __future__ import annotations

from llmem.learn.points import BACKWARD as B
from llmem.learn.points import FORWARD as F
from llmem.learn.points import VisionReading
from llmem.learn.vision_read import read_vision
from llmem.memory.activations.learned_vision import LearnedPiece, LearnedVision, Op

ACT = "activations"


def _step() -> VisionReading:
    events = [
        (True, 1, 100, F, ACT, "model.visual.patch_embed.proj"),         # kept: freed in backward (never, here)
        (True, 2, 50, F, ACT, "model.visual.blocks.0.attn"),             # a temporary of block 0
        (True, 3, 8192, F, "cuda_workspaces", "model.visual.blocks.0.attn.qkv"),   # cuBLAS's, at the first matmul
        (True, 4, 200, F, ACT, "model.visual.blocks.0.mlp"),             # kept by block 0
        (False, 2, 0, F, ACT, ""),
        (True, 5, 300, F, ACT, "model.language_model.layers.0"),         # the language model's: not the vision side
        (True, 6, 300, B, ACT, "model.language_model.layers.0"),         # its backward
        (False, 5, 0, B, ACT, ""),
        (True, 7, 64, B, ACT, "model"),                                  # the scatter's backward
        (True, 8, 400, B, "gradients", "model.visual.blocks.0.mlp"),    # a weight's gradient
        (False, 4, 0, B, ACT, ""),
        (False, 7, 0, B, ACT, ""),
        (True, 9, 32, B, ACT, "model.visual.patch_embed.proj"),
        (True, 10, 1000, B, "gradients", "model.language_model.embed_tokens"),   # the embedding's: the schedule's
        (False, 9, 0, B, ACT, ""),
    ]
    grads = {8: "model.visual.blocks.0.mlp.up_proj.weight", 10: "model.language_model.embed_tokens.weight"}
    return VisionReading("model.visual", "model.language_model.layers", events, grads)


def test_pieces_forward_and_backward_are_read_in_order():
    got = read_vision(_step())
    assert got == LearnedVision(
        pieces=(LearnedPiece("patch_embed", "patch_embed", (100,), (ACT,)),
                LearnedPiece("blocks.0", "blocks.0", (200,), (ACT,))),
        forward=((Op.KEEP, 0, 0, None, ""), (Op.TEMP, 1, 2, 50, ACT), (Op.WORKSPACE, -1, 0, None, ""),
                 (Op.KEEP, 1, 0, None, ""), (Op.FREE, -1, 2, None, "")),
        backward=((Op.TEMP, -1, 7, 64, ACT), (Op.GRAD, 1, 0, 400, "model.visual.blocks.0.mlp.up_proj.weight"),
                  (Op.FREE_KEPT, 1, 0, None, ""), (Op.FREE, -1, 7, None, ""), (Op.TEMP, 0, 9, 32, ACT),
                  (Op.LATE, -1, 9, None, "")))
    assert LearnedVision.from_json(got.to_json()) == got      # the disk cache's form


def test_peft_names_its_parameters_under_base_model():
    step = _step()
    step.grads = {k: "base_model.model." + n for k, n in step.grads.items()}
    step.module = "base_model.model.model.visual"
    step.layers_path = "base_model.model.model.language_model.layers"
    step.events = [(a, k, n, ph, c, "base_model.model." + m if m else m) for a, k, n, ph, c, m in step.events]
    grad = next(op for op in read_vision(step).backward if op[0] == Op.GRAD)
    assert grad[4] == "model.visual.blocks.0.mlp.up_proj.weight"


def test_an_encoder_without_a_graph_has_no_backward():
    """A frozen encoder whose input needs no gradient keeps nothing: its forward's temporaries alone."""
    events = [(True, 1, 50, F, ACT, "model.visual.blocks.0.attn"), (False, 1, 0, F, ACT, ""),
              (True, 2, 300, F, ACT, "model.language_model.layers.0"), (True, 3, 300, B, ACT,
                                                                           "model.language_model.layers.0")]
    got = read_vision(VisionReading("model.visual", "model.language_model.layers", events, {}))
    assert got.pieces == (LearnedPiece("blocks.0", "blocks.0", (), ()),)
    assert got.backward == ()
    assert read_vision(VisionReading("model.visual", "model.language_model.layers", events[2:], {})) is None
