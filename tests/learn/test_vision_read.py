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
    return VisionReading("model.visual", "model.language_model.layers", events, grads, ("model.visual",),
                         "model.visual.blocks")


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
    step.modules, step.blocks = (step.module,), step.module + ".blocks"
    step.layers_path = "base_model.model.model.language_model.layers"
    step.events = [(a, k, n, ph, c, "base_model.model." + m if m else m) for a, k, n, ph, c, m in step.events]
    grad = next(op for op in read_vision(step).backward if op[0] == Op.GRAD)
    assert grad[4] == "model.visual.blocks.0.mlp.up_proj.weight"


def test_an_encoder_without_a_graph_has_no_backward():
    """A frozen encoder whose input needs no gradient keeps nothing: its forward's temporaries alone."""
    events = [(True, 1, 50, F, ACT, "model.visual.blocks.0.attn"), (False, 1, 0, F, ACT, ""),
              (True, 2, 300, F, ACT, "model.language_model.layers.0"), (True, 3, 300, B, ACT,
                                                                           "model.language_model.layers.0")]
    got = read_vision(VisionReading("model.visual", "model.language_model.layers", events, {}, ("model.visual",),
                                    "model.visual.blocks"))
    assert got.pieces == (LearnedPiece("blocks.0", "blocks.0", (), ()),)
    assert got.backward == ()
    assert read_vision(VisionReading("model.visual", "model.language_model.layers", events[2:], {})) is None


def test_a_projector_beside_the_encoder_and_a_tied_embedding():
    """Gemma 3's layout: the projector (model.multi_modal_projector) beside the vision tower, both read as the vision
    side under their shared root (model); the token embedding's backward (its scale's gradient, then a tied weight's
    new gradient before AccumulateGrad sums it into the lm_head's) is left to the schedule, from its first
    allocation."""
    events = [
        (True, 1, 100, F, ACT, "model.vision_tower.embeddings.patch_embedding"),
        (True, 2, 200, F, ACT, "model.vision_tower.encoder.layers.0.mlp.fc1"),
        (True, 3, 40, F, ACT, "model.multi_modal_projector.avg_pool"),
        (True, 4, 300, F, ACT, "model.language_model.layers.0"),
        (True, 5, 300, B, ACT, "model.language_model.layers.0"),
        (False, 4, 0, B, ACT, ""),
        (True, 6, 64, B, ACT, "model"),                                      # the scatter's backward
        (True, 7, 16, B, "gradients", "model.multi_modal_projector"),        # the projection matrix's gradient
        (False, 3, 0, B, ACT, ""),
        (True, 8, 8, B, "gradients", "model.vision_tower.encoder.layers.0.mlp.fc1"),
        (False, 2, 0, B, ACT, ""),
        (True, 9, 64, B, ACT, "model.language_model.embed_tokens"),          # the embedding scale's backward
        (True, 10, 1000, B, ACT, "model.language_model.embed_tokens"),       # the tied weight's new gradient
        (False, 6, 0, B, ACT, ""),
    ]
    grads = {7: "model.multi_modal_projector.mm_input_projection_weight",
             8: "model.vision_tower.encoder.layers.0.mlp.fc1.weight"}
    got = read_vision(VisionReading("model", "model.language_model.layers", events, grads,
                                    ("model.vision_tower", "model.multi_modal_projector"),
                                    "model.vision_tower.encoder.layers"))
    assert [p.module for p in got.pieces] == ["vision_tower", "vision_tower.encoder.layers.0", "multi_modal_projector"]
    assert [p.tensors for p in got.pieces] == [(100,), (200,), (40,)]
    assert got.backward == ((Op.TEMP, -1, 6, 64, ACT),
                            (Op.GRAD, 2, 0, 16, "model.multi_modal_projector.mm_input_projection_weight"),
                            (Op.FREE_KEPT, 2, 0, None, ""),
                            (Op.GRAD, 1, 0, 8, "model.vision_tower.encoder.layers.0.mlp.fc1.weight"),
                            (Op.FREE_KEPT, 1, 0, None, ""),
                            (Op.LATE, -1, 6, None, ""))


def test_cross_attention_reads_the_vision_backward_after_the_embedding():
    """Llama 3.2 Vision's layout: the projected image features reach the decoder layers through cross-attention, so
    autograd runs the token embedding's backward (its forward ran after the tower's: a higher sequence number)
    before the projector's. The embedding's events are the schedule's; the vision side's backward is read from its
    first allocation (after_embedding), where a scatter's model would stop at the embedding's gradient."""
    events = [
        (True, 1, 100, F, ACT, "model.vision_model.patch_embedding"),
        (True, 2, 40, F, ACT, "model.multi_modal_projector"),
        (True, 3, 300, F, ACT, "model.language_model.layers.0"),
        (True, 4, 300, B, ACT, "model.language_model.layers.0.cross_attn.k_proj"),   # the features' gradient
        (False, 3, 0, B, ACT, ""),
        (True, 5, 1000, B, "gradients", "model.language_model.embed_tokens"),         # the embedding's: the schedule's
        (True, 6, 16, B, "gradients", "model.multi_modal_projector"),
        (False, 4, 0, B, ACT, ""),
        (False, 2, 0, B, ACT, ""),
        (True, 7, 8, B, "gradients", "model.vision_model.patch_embedding"),
        (False, 1, 0, B, ACT, ""),
    ]
    grads = {5: "model.language_model.embed_tokens.weight", 6: "model.multi_modal_projector.weight",
             7: "model.vision_model.patch_embedding.weight"}
    reading = VisionReading("model", "model.language_model.layers", events, grads,
                            ("model.vision_model", "model.multi_modal_projector"), "model.vision_model.transformer.layers")
    assert read_vision(reading).backward == ()        # as a scatter's model reads it: stopped at the embedding's
    reading.after_embedding = True
    assert read_vision(reading).backward == ((Op.GRAD, 1, 0, 16, "model.multi_modal_projector.weight"),
                                             (Op.FREE_KEPT, 1, 0, None, ""),
                                             (Op.GRAD, 0, 0, 8, "model.vision_model.patch_embedding.weight"),
                                             (Op.FREE_KEPT, 0, 0, None, ""))
