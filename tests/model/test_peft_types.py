"""peft types beyond LoRA / IA3 / prompt tuning: the trainable sets and buffers of the CI configs
(llmem/model/catalog/peft) worked out from peft's own formulas, the data-free build, the host reads peft's
adapters make in training, and the read layer's own module objects for peft's cross-layer adapters.

tiny-llama (llmem/catalog/tiny): 4 layers, hidden 512, q_proj and v_proj both [512, 512] (8 kv heads of 64), so a
q,v config adapts 8 modules of in = out = 512."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmem.model.anatomy import load_anatomy
from llmem.model.peft import trained_anatomy
from llmem.model.peft_data_free import DATA_FREE_NOTE, host_mask
from llmem.setup.training import TrainingSetup
from llmem.validate.matrices import CI_MATRIX, PEFT_LEARNED_ROWS
from llmem.validate.rows import bundled_peft_config

MODULES, IN, OUT = 8, 512, 512      # q_proj and v_proj of 4 layers


def _anatomy(name: str):
    setup = TrainingSetup(model="tiny-llama", peft_config=bundled_peft_config(name), gpu="H100-80GB")
    return trained_anatomy(load_anatomy("tiny-llama"), setup)


def _trainable(anatomy) -> int:
    return sum(p.numel for p in anatomy.params if p.trainable)


def test_loha_trainable_by_hand():
    # peft/tuners/loha/layer.py create_adapter_parameters: hada_w1_a [out, r], hada_w1_b [r, in], and w2 alike
    r = 32
    assert _trainable(_anatomy("loha-r32-q-v")) == MODULES * 2 * r * (IN + OUT) == 524_288


def test_vera_trainable_and_shared_buffers_by_hand():
    # peft/tuners/vera/layer.py update_layer: vera_lambda_d [r] and vera_lambda_b [out] per module; the model's
    # vera_A [r, largest in] and vera_B [largest out, r] (vera/model.py _init_vera_A_vera_B) registered once
    r = 256
    a = _anatomy("vera-r256-q-v")
    assert _trainable(a) == MODULES * (r + OUT) == 6_144
    assert sorted(b.shape for b in a.buffers) == [(r, IN), (OUT, r)]
    assert not any(b.trainable for b in a.buffers)


def test_mica_built_data_free_trains_lora_a_only():
    # MiCA (peft/tuners/lora/variants.py MiCALinearVariant.init): lora_B frozen, lora_A [r, in] trained; its
    # init (LoraLayer.mica_init: an SVD of the base weight) cannot run on the meta device, so it is built data-free
    r = 32
    a = _anatomy("lora-mica-r32-q-v")
    assert _trainable(a) == MODULES * r * IN == 131_072
    frozen_b = [p for p in a.params if ".lora_B." in p.name]
    assert len(frozen_b) == MODULES and not any(p.trainable for p in frozen_b)
    assert any(DATA_FREE_NOTE in n for n in a.peft.notes) and not a.peft.exact


def test_fourierft_trainable_by_hand():
    # peft/tuners/fourierft/layer.py update_layer: fourierft_spectrum [n_frequency] per module (n_frequency 1000)
    assert _trainable(_anatomy("fourierft-q-v")) == MODULES * 1000


def test_every_learned_peft_row_is_in_the_ci_matrix():
    rows = {s.peft_config for s in CI_MATRIX if s.peft_config}
    assert {bundled_peft_config(n) for n in PEFT_LEARNED_ROWS} <= rows


def test_shira_host_mask_has_peft_entry_count():
    # peft/tuners/shira/layer.py update_layer: r * (in + out) weights, the mask's ones counted by torch.where
    mask = host_mask(nn.Linear(48, 40), 2)
    assert mask.shape == (40, 48) and int(mask.sum()) == 2 * (48 + 40)


def test_shira_is_built_data_free_with_a_note(tmp_path):
    from peft import ShiraConfig

    folder = tmp_path / "shira"
    ShiraConfig(r=4, target_modules=["q_proj"]).save_pretrained(str(folder))
    setup = TrainingSetup(model="tiny-llama", peft_config=str(folder), gpu="H100-80GB")
    a = trained_anatomy(load_anatomy("tiny-llama"), setup)
    assert _trainable(a) == 4 * 4 * (IN + OUT)        # 4 layers' q_proj, r * (in + out) each
    assert any(DATA_FREE_NOTE in n for n in a.peft.notes)


def test_host_reads_answer_draws_and_checks_as_a_usual_run():
    from torch._subclasses.fake_tensor import DataDependentOutputException

    from llmem.runtime.ledger import TracingFakeMode

    with TracingFakeMode():
        assert bool(torch.rand(1) > 0.0)          # LoHa / LoKr: module_dropout 0, the adapter runs
        assert not bool(torch.rand(1) > 0.9)      # a 90 % module dropout: most steps skip it
        assert bool(torch.rand(1) < 0.9)
        x = torch.empty(3, 4)
        assert not bool(x[0, 0].isinf().any())    # VB-LoRA's check: a healthy run's values are finite
        assert not bool(x.isnan().any())
        with pytest.raises(DataDependentOutputException):
            bool(x.sum() > 0)                     # any other read of a value stays data-dependent


def test_unshare_gives_the_read_layer_its_own_modules_over_the_same_tensors():
    from llmem.learn.unshare import unshare_layer

    shared = nn.Linear(4, 4)
    shared.register_buffer("proj", torch.ones(2))
    layers = [nn.Sequential(nn.Linear(4, 4), shared) for _ in range(3)]
    replaced = unshare_layer(layers, 1)
    assert replaced == ["1"]
    own = layers[1][1]
    assert own is not shared and layers[0][1] is shared and layers[2][1] is shared
    assert own.weight is shared.weight and own.proj is shared.proj
    x = torch.randn(2, 4)
    layers[1](x).sum().backward()                 # autograd accumulates into the one shared leaf
    assert shared.weight.grad is not None


def test_shira_trainable_and_host_indices_by_hand():
    # peft/tuners/shira/layer.py update_layer: shira_weight [r * (in + out)] per module, and shira_indices
    # [2, r * (in + out)] (torch.where of the mask, .to(torch.int)) held in a plain dict, kept on the GPU by
    # get_delta_weight: counted as buffers of the module
    n = 32 * (IN + OUT)
    a = _anatomy("shira-r32-q-v")
    assert _trainable(a) == MODULES * n == 262_144
    indices = [b for b in a.buffers if ".shira_indices." in b.name]
    assert len(indices) == MODULES and {(b.shape, b.dtype) for b in indices} == {((2, n), "int32")}
    assert sum(b.own_bytes for b in indices) == MODULES * 2 * n * 4


def test_waveft_and_fourierft_indices_are_int64_buffers():
    # torch.randperm's int64 positions, stacked as [2, n_frequency] (fourierft/layer.py, waveft/layer.py)
    for name, n in (("fourierft-q-v", 1000), ("waveft-q-v", 5000)):
        found = [b for b in _anatomy(name).buffers if "indices" in b.name]
        assert len(found) == MODULES and {(b.shape, b.dtype) for b in found} == {((2, n), "int64")}
    assert _trainable(_anatomy("waveft-q-v")) == MODULES * 5000


def test_fake_sparse_mask_keeps_the_mask_entries():
    from llmem.runtime.ledger import TracingFakeMode

    with TracingFakeMode(allow_non_fake_inputs=True):
        values = torch.ones(5, requires_grad=True)
        delta = torch.sparse_coo_tensor(torch.zeros(2, 5, dtype=torch.long), values * 2, (4, 4),
                                        check_invariants=False)
        (torch.zeros(4, 4) + delta).sum().backward()      # SparseCooTensorWithDimsAndTensorsBackward0
        assert values.grad.shape == (5,)


def test_lily_shared_b_is_copied_by_each_layer_not_by_the_holder():
    # peft/tuners/lily: A (one per stride_A layers) and num_B B's shared by every layer, held by layer 0. Each
    # layer reads B through `lily_B.weight.reshape(...)`, a view autocast casts at every use (the learned layer
    # holds that copy); A is called as a module, its leaf weight's copy cached, and each layer has its own router
    from llmem.estimator.param_facts import shared_parts

    a = _anatomy("lily-r140-mlp")
    assert sorted(shared_parts(a)) == [f"model.layers.0.mlp.{m}.lily_B.default.weight"
                                       for m in ("down_proj", "gate_proj", "up_proj")]
    assert shared_parts(_anatomy("vera-r256-q-v")) == frozenset()      # VeRA's shared A / B are buffers


@pytest.mark.slow
def test_lily_r896_estimate_within_2_percent_of_the_trace_at_batch_1(tmp_path, monkeypatch):
    # the survey's set-up that was +3.2 % reserved (benchmarks/peft_types.md, peft's benchmark config
    # lily--llama-3.2-3B-rank896-a2-b2-s2.0): layer 0 had B's copy twice
    import json

    import llmem
    from llmem.memory.activations.learned import LEARN_ENV

    monkeypatch.setenv(LEARN_ENV, "auto")        # Lily's activations are learned from the real code
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LILY", "r": 896, "stride_A": 14, "num_B": 2, "scaling": 2.0,
         "target_modules": ["q_proj", "v_proj"], "init_weights": True}))
    kw = dict(peft_config=str(tmp_path), seq_len=512, batch_size=1, gpu="H100-80GB")
    est, tr = llmem.estimate("tiny-llama", **kw), llmem.trace("tiny-llama", **kw)
    for counter in ("peak_allocated_bytes", "peak_reserved_bytes"):
        assert abs(getattr(est, counter) / getattr(tr, counter) - 1) < 0.02
