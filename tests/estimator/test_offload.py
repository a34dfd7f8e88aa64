"""FSDP2's CPUOffloadPolicy (--offload-param) by hand: what stays on the device, the host RAM, the copies and the
host's optimizer step in the time model. tiny-llama: hidden 512, 4 layers of q, k, v, o 512 x 512, gate, up, down
512 x 1376 and two norms (3,163,136 parameters), embed_tokens and lm_head 32000 x 512 each, the final norm 512."""

from __future__ import annotations

import pytest

from llmem.estimator.events import ALL_GATHER, REDUCE_SCATTER
from llmem.estimator.schedule import StepSchedule
from llmem.estimator.states import cpu_offload_host_bytes, model_states
from llmem.memory.activations.profile import activation_profile
from llmem.model.resolved import resolve
from llmem.setup.training import TrainingSetup

LAYER = 4 * 512 * 512 + 3 * 512 * 1376 + 2 * 512          # 3,163,136
EMBED = 32000 * 512                                        # embed_tokens, and lm_head alike
TOTAL = 2 * EMBED + 512 + 4 * LAYER                        # 45,421,056


def _resolved(method="fsdp", gpus=2, **kw):
    return resolve(TrainingSetup(model="tiny-llama", method=method, gpus=gpus, gpu="H100-80GB", batch_size=1,
                                 seq_len=64, offload_param=True, **kw))


def test_only_the_gathered_units_and_their_buffers_stay_on_the_device():
    """bf16-mixed on 2 GPUs: no weights, gradients or optimizer states on the device; a layer gathered in bf16, its
    fp32 reduce-scatter input, the root (embeddings, lm_head, norm) gathered in bf16."""
    ms = model_states(_resolved(precision="bf16-mixed"))
    assert (ms.weights, ms.gradients, ms.optimizer_states, ms.optimizer_temporaries, ms.layer_grads) == (0,) * 5
    assert ms.fsdp_layer_gathered == LAYER * 2 == 6_326_272
    assert ms.fsdp_layer_reduce == LAYER * 4
    assert ms.fsdp_root_gathered == (2 * EMBED + 512) * 2 == 65_537_024


def test_host_ram_is_the_shards_their_gradients_and_the_optimizer():
    """Every parameter splits evenly over 2 ranks (22,710,528 each): fp32 shards and fp32 gradients pinned; AdamW's
    two fp32 states, and its for-loop step on the host (two temporaries of the largest shard, embed_tokens' 16000 x
    512)."""
    host = cpu_offload_host_bytes(_resolved(precision="bf16-mixed"))
    shard = TOTAL // 2
    assert host.pinned == shard * (4 + 4) == 181_684_224
    assert host.optimizer == shard * 2 * 4 + 2 * (EMBED // 2) * 4 == 247_220_224


def _events(sch: StepSchedule, run) -> list[tuple]:
    """The events `run` adds: (+1, bytes, stream) for an allocation, (-1, bytes) for a free."""
    start = len(sch.sch.events)
    run()
    return [(sign, size, stream)[:3 if sign > 0 else 2] for sign, _k, size, stream, _c in sch.sch.events[start:]]


def test_each_shard_is_copied_from_the_host_then_cast_before_the_all_gather():
    """FSDPParam.all_gather_inputs under CPUOffloadPolicy, bf16-mixed on 2 GPUs: per parameter (in module order) the
    fp32 shard's copy, its bf16 cast, the copy freed; then the gathered output; then the inputs freed."""
    r = _resolved(precision="bf16-mixed")
    sch = StepSchedule(r, activation_profile(r))
    layer = sch.facts.unit(0)
    shards = [512 * 512 // 2] * 4 + [512 * 1376 // 2] * 3 + [256, 256]
    want = [x for n in shards for x in ((1, n * 4, ALL_GATHER), (1, n * 2, ALL_GATHER), (-1, n * 4))]
    want += [(1, LAYER * 2, ALL_GATHER)] + [(-1, n * 2) for n in shards]
    assert _events(sch, lambda: sch.units.all_gather(layer)) == want


def test_fp32_copies_are_the_all_gather_inputs_themselves():
    """fp32 (no MixedPrecisionPolicy): nothing to cast, so each fp32 copy is the input until the copy-in is done."""
    r = _resolved(precision="fp32")
    sch = StepSchedule(r, activation_profile(r))
    shards = [512 * 512 // 2] * 4 + [512 * 1376 // 2] * 3 + [256, 256]
    want = [(1, n * 4, ALL_GATHER) for n in shards] + [(1, LAYER * 4, ALL_GATHER)]
    want += [(-1, n * 4) for n in shards]
    assert _events(sch, lambda: sch.units.all_gather(sch.facts.unit(0))) == want


def test_the_reduce_scatter_output_leaves_for_the_host_at_once():
    """foreach_reduce copies the sharded gradients to the host as it returns: its fp32 output (half a layer on
    2 GPUs) is freed right after it is made, and no sharded gradient waits for the optimizer step on the device."""
    r = _resolved(precision="bf16-mixed")
    sch = StepSchedule(r, activation_profile(r))
    events = _events(sch, lambda: sch.reduce_scatter_layer(0))
    out = LAYER * 4 // 2
    assert events[-2:] == [(1, out, REDUCE_SCATTER), (-1, out)]
    assert sch.state.units.rs_outputs == []


def test_whole_step_holds_nothing_but_buffers_after_the_optimizer_step():
    """Two iterations of the offloaded step: at the end only the cuBLAS workspace is live (no parameter, gradient
    or optimizer state was ever allocated on the device)."""
    r = _resolved(precision="bf16-mixed")
    events = StepSchedule(r, activation_profile(r)).build().events
    held = sum(sign * size for sign, _k, size, _s, _c in events)
    assert held == r.gpu.cublas_workspace_bytes
    assert not any(c in ("weights", "optimizer_states") for _s, _k, _n, _st, c in events)


def test_a_quantised_base_offloaded_only_where_fsdp2_offloads_its_storage():
    # bitsandbytes' packed NF4 is FSDP2's plain sharded parameter (tests/estimator/test_qlora_cpu_offload.py);
    # torchao's NF4Tensor is copied through its subclass: refused
    from llmem.errors import LlmemError

    assert model_states(_resolved(precision="bf16-mixed", lora_rank=8, quant_base="nf4", kbit_upcast=False)).gradients == 0
    with pytest.raises(LlmemError, match="--offload-param with a --qlora-torchao base"):
        model_states(_resolved(precision="bf16", lora_rank=8, quant_base="torchao-nf4", adapter_dtype="base"))


def test_host_copies_and_step_in_the_time_model_by_hand():
    """Llama-3.1-70B (70,553,706,496 parameters, root 2 x 128256 x 8192 + 8192) on fsdp over 8 A100s, bf16-mixed:
    each rank's fp32 shard crosses PCIe once per all-gather pass (forward and backward: fsdp reshards), its fp32
    gradients once; the host's AdamW steps 8.8 G parameters. At batch 1 x 4096 the copies hide behind compute
    except the root unit's, exposed with its gather, so the step grows by that and the host's step."""
    from llmem.model.anatomy import load_anatomy
    from llmem.model.resolved import assemble
    from llmem.planner.timing import HOST_ADAMW_PARAMS_PER_S, PCIE_GBPS, host_copies, step_time
    from llmem.setup.gpus import resolve_gpu
    from llmem.setup.layout import resolve_layout

    anatomy, gpu = load_anatomy("meta-llama/Llama-3.1-70B"), resolve_gpu("A100-80GB")
    layout = resolve_layout("fsdp", 8, None, None, 0, 0)
    base = TrainingSetup(model="meta-llama/Llama-3.1-70B", method="fsdp", gpus=8, gpu="A100-80GB", seq_len=4096)
    plain = assemble(base.with_layout(layout, 1), anatomy, gpu, layout)
    offloaded = assemble(TrainingSetup(**{**base.to_dict(), "offload_param": True}).with_layout(layout, 1),
                         anatomy, gpu, layout)
    shard = 70_553_706_496 / 8
    c = host_copies(offloaded)
    assert c.params_s == pytest.approx(shard * 4 / (PCIE_GBPS * 1e9))
    assert c.grads_s == pytest.approx(shard * 4 / (PCIE_GBPS * 1e9))
    root = 2 * 128256 * 8192 + 8192
    assert c.root_s == pytest.approx(root / 8 * 4 / (PCIE_GBPS * 1e9))
    assert c.step_s == pytest.approx(shard / HOST_ADAMW_PARAMS_PER_S) == pytest.approx(88.19, abs=0.01)
    t0, t1 = step_time(plain, 1), step_time(offloaded, 1)
    assert t1.step_s == pytest.approx(t0.step_s + c.root_s + c.step_s)
    assert t1.host_copy_s == pytest.approx(2 * c.params_s + c.grads_s)
    assert host_copies(plain).step_s == 0


def test_host_tensors_never_reach_the_device_ledger():
    """The trace's host side: storages born in region(HOST) get no event (nor do their views); pinning a fake tensor
    returns it as it is; a device tensor beside them is counted (256 fp32 = 1024 B)."""
    import torch

    from llmem.runtime.ledger import HOST, Ledger, TracingFakeMode

    ledger = Ledger()
    mode = TracingFakeMode()
    mode.ledger = ledger
    with mode:
        with ledger.region(HOST):
            host = torch.empty(1024)
            pinned = host.pin_memory()
        ledger.track(host[:10])
        device = torch.empty(256)
    assert pinned is host and device.numel() == 256
    assert [(is_alloc, size) for is_alloc, _k, size, *_ in ledger.events] == [(True, 1024)]


def test_fused_adamw_steps_on_the_meta_host():
    """torchtune's 70B full fine-tune: CPUOffloadPolicy with AdamW(fused=True). torch's fused kernel refuses meta
    tensors, so the meta host runs the update as the for-loop AdamW: each shard gets both fp32 states, on the host."""
    import torch

    from llmem.runtime.optimizers import HostOffloadedOptimizer

    model = torch.nn.Linear(8, 4)
    opt = HostOffloadedOptimizer(model, "adamw-fused")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    states = [opt.host.state[host] for _, host in opt.pairs]
    assert [tuple(s["exp_avg"].shape) for s in states] == [(4, 8), (4,)]
    assert {(s[k].device.type, s[k].dtype) for s in states for k in ("exp_avg", "exp_avg_sq")} == \
        {("meta", torch.float32)}
