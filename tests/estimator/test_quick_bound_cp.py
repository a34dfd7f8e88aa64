"""The quick bound (tensor bytes at the step's largest moment, no allocator replay) under --cp: the rank's step at
seq_len / cp with the ring's buffers, as the full estimate runs it. The planner's screens need it at or above the
twin's (FSDP over dp x cp at seq_len / cp: the same shards and tokens, no ring) and within QUICK_SLACK's 1.16 of
the full estimate's allocated peak; at the whole sequence it lay cp times over in activations."""

import pytest

from llmem.model.anatomy import load_anatomy
from llmem.planner.engines import LlmemEngine
from llmem.planner.search import layout_setup, quick_twin
from llmem.setup.gpus import resolve_gpu
from llmem.setup.layout import ModelLimits, candidate_layouts
from llmem.setup.training import TrainingSetup


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_quick_bound_models_the_ring(cp: int, batch: int) -> None:
    anatomy = load_anatomy("tiny-llama")
    base = TrainingSetup(model="tiny-llama", gpus=8, gpu="A100-80GB", seq_len=256)
    layout = next(lay for lay in candidate_layouts(8, 8, anatomy.num_heads, anatomy.num_kv_heads,
                                                    limits=ModelLimits(anatomy.num_layers, 256), cp=None)
                  if lay.cp == cp and lay.pp == 1 and lay.tp == 1)
    engine = LlmemEngine(anatomy, resolve_gpu("A100-80GB"))
    setup = layout_setup(base, layout, batch)
    quick = engine.quick(setup)
    twin_setup, twin = quick_twin(base, layout)
    assert twin_setup.seq_len == 256 // cp and twin.dp == 8 and twin.cp == 1
    assert quick >= engine.quick(layout_setup(twin_setup, twin, batch))
    allocated = engine.full(setup).peak_allocated_bytes
    assert 0.9 * allocated <= quick <= 1.16 * allocated
