"""FSDP2's reshard_after_forward as an int (--reshard-after-forward N), by hand and against torch's own FSDP2.

After forward each decoder layer keeps the rank's 1/N of its all-gather output (FSDPParam.to_sharded_post_forward):
per parameter dim 0 padded to a multiple of the shard world, in MixedPrecisionPolicy's param_dtype, over N.
tiny-llama: 4 layers of q, k, v, o 512 x 512, gate, up 1376 x 512, down 512 x 1376 and two norms of 512.
tiny-mistral: k, v 128 x 512 (2 kv heads of 64), gate, up 1792 x 512, down 512 x 1792."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from llmem.cli import main
from llmem.errors import LlmemError
from llmem.estimator.events import ALL_GATHER
from llmem.estimator.moments import step_moments
from llmem.estimator.post_forward import post_forward_layer_bytes
from llmem.estimator.schedule import StepSchedule
from llmem.estimator.states import model_states
from llmem.memory.activations.profile import activation_profile
from llmem.model.resolved import resolve
from llmem.planner.export import ExportPlan
from llmem.planner.export_torchtitan import torchtitan_sections
from llmem.setup.layout import Layout
from llmem.setup.methods import METHODS
from llmem.setup.support import check_support
from llmem.setup.training import TrainingSetup

LLAMA_LAYER = 4 * 512 * 512 + 3 * 512 * 1376 + 2 * 512          # 3,163,136 elements, none padded over 4


def _pad(rows: int, shards: int) -> int:
    return -(-rows // shards) * shards


def _mistral_layer_padded(shards: int) -> int:
    """tiny-mistral's layer as FSDP2 all-gathers it over `shards` ranks: each dim 0 padded to a multiple."""
    return (2 * _pad(512, shards) * 512 + 2 * _pad(128, shards) * 512 + 2 * _pad(1792, shards) * 512
            + _pad(512, shards) * 1792 + 2 * _pad(512, shards))


def _setup(model: str = "tiny-llama", gpus: int = 4, n: int | None = 2, **kw) -> TrainingSetup:
    return TrainingSetup(model=model, method=kw.pop("method", "fsdp"), gpus=gpus, precision="bf16-mixed",
                         batch_size=2, seq_len=64, reshard_after_forward=n, **kw)


def test_post_forward_shards_by_hand():
    # bf16 (2 bytes) over N = 2: a whole layer's bytes / 2
    assert post_forward_layer_bytes(resolve(_setup())) == LLAMA_LAYER * 2 // 2 == 3_163_136
    # over 6 shard ranks 512 rows pad to 516, 128 to 132, 1792 to 1794; then / N = 3
    assert _mistral_layer_padded(6) == 3_426_312
    assert post_forward_layer_bytes(resolve(_setup("tiny-mistral", 6, 3))) == 3_426_312 * 2 // 3
    # HSDP 2 x 4: sharded over the 4 of a replica, as plain FSDP over 4
    assert post_forward_layer_bytes(resolve(_setup(gpus=8, dp_replicate=2))) == 3_163_136
    assert post_forward_layer_bytes(resolve(_setup(n=None))) == 0


def test_torch_keeps_the_same_post_forward_shards():
    """torch's FSDP2 itself (fake process group, 6 ranks, reshard_after_forward=3, bf16 MixedPrecisionPolicy) on a
    layer of tiny-mistral's shapes: the clones FSDPParam.to_sharded_post_forward keeps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from llmem.runtime.distributed import fake_process_group

    r = resolve(_setup("tiny-mistral", 6, 3))
    shapes = [p.shape for p in r.anatomy.params if p.layer_index == 0]

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ps = nn.ParameterList(nn.Parameter(torch.zeros(s)) for s in shapes)

        def forward(self, x):
            return x + sum(p.sum() for p in self.ps)

    with fake_process_group(6):
        root = nn.Sequential(Layer())
        mesh = init_device_mesh("cpu", (6,))
        fully_shard(root[0], mesh=mesh, reshard_after_forward=3,
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        fully_shard(root, mesh=mesh)
        root(torch.zeros(1, requires_grad=True))
        group = root[0]._get_fsdp_state()._fsdp_param_group
        kept = [p._sharded_post_forward_param_data for p in group.fsdp_params]
        kept_bytes = sum(t.numel() * t.element_size() for t in kept)
    assert {t.dtype for t in kept} == {torch.bfloat16}
    assert kept_bytes == post_forward_layer_bytes(r) == 3_426_312 * 2 // 3


def _schedule(n: int | None) -> StepSchedule:
    r = resolve(_setup(n=n))
    s = StepSchedule(r, activation_profile(r))
    s.setup_phase()
    s.forward(0)
    return s


def _backward_cast_ins(s: StepSchedule) -> int:
    """The backward all-gathers' copy-in casts of a layer (its bf16 unit over the 4 shard ranks)."""
    start = len(s.sch.events)
    s.backward(0)
    cast = LLAMA_LAYER * 2 // 4
    return sum(1 for sign, _, size, stream, _ in s.sch.events[start:] if sign > 0 and stream == ALL_GATHER
               and size == cast)


def test_schedule_keeps_the_shards_until_backward_reads_them():
    s = _schedule(2)
    held = [s.sch.size_of(k) for keys in s.state.units.post_forward_shards.values() for k in keys]
    assert sum(held) == 4 * LLAMA_LAYER * 2 // 2 and len(held) == 4 * 9     # 9 parameters per layer
    assert all(i not in s.state.units.gathered for i in range(4))                       # the unsharded layers are freed
    # backward all-gathers from the bf16 shards: no cast of the fp32 shard on the copy-in (fsdp's default casts)
    assert _backward_cast_ins(s) == 0
    assert s.state.units.post_forward_shards == {}
    assert _backward_cast_ins(_schedule(None)) == 4


def test_moments_hold_every_layer_at_the_loss():
    def forward_gathered(n):
        r = resolve(_setup(n=n))
        return step_moments(r, activation_profile(r), model_states(r))[0].components["gathered_weights"]
    assert forward_gathered(2) - forward_gathered(None) == 4 * 3_163_136


@pytest.mark.parametrize("kw,why", [
    ({"n": 4}, "must divide FSDP2's 4 shard ranks with 1 < N < 4 (1 is zero2's False, 4 fsdp's default True): "
               "choose 2"),
    ({"n": 1}, "1 < N < 4"),
    ({"gpus": 8, "n": 3}, "choose 2 or 4"),
    ({"gpus": 2, "n": 2}, "2 shard ranks have none"),
    ({"gpus": 8, "n": 4, "dp_replicate": 2}, "FSDP2's 4 shard ranks"),
    ({"method": "zero2"}, "under --method fsdp only, got zero2"),
    ({"method": "fsdp+tp", "tp": 2}, "got fsdp+tp"),
    ({"offload_param": True}, "with --offload-param is not modelled"),
    ({"gpus": 8, "pp": 2}, "with --pp"),
    ({"objective": "dpo"}, "with --objective dpo"),
])
def test_refusals(kw, why):
    s = _setup(**kw)
    with pytest.raises(LlmemError) as exc:
        check_support(s, METHODS[s.method])
    assert why in str(exc.value)


def test_cli_refusal_is_one_line(capsys):
    argv = ["estimate", "tiny-llama", "--method", "fsdp", "--gpus", "4", "--reshard-after-forward", "3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--reshard-after-forward 3 must divide" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_torchtitan_export_refuses_the_int():
    e = ExportPlan("meta-llama/Llama-3.1-8B", "LlamaForCausalLM", Layout("fsdp", 4, 1, 4), 2, 1, 2048,
                   "bf16-mixed", True, False, "adamw")
    p = SimpleNamespace(setup=TrainingSetup(model="meta-llama/Llama-3.1-8B", method="fsdp", gpus=4,
                                            reshard_after_forward=2))
    with pytest.raises(LlmemError, match="fsdp_reshard_after_forward is default / always / never, not FSDP2's int"):
        torchtitan_sections(p, e)


@pytest.mark.parametrize("kind", ["accelerate", "torchrun"])
def test_accelerate_and_torchrun_exports_refuse_the_int(kind):
    """accelerate's fsdp_reshard_after_forward and the torchrun script's fully_shard call take a bool only."""
    from llmem.planner.export import check_exportable

    setup = TrainingSetup(model="tiny-llama", method="fsdp", gpus=4, reshard_after_forward=2)
    with pytest.raises(LlmemError, match="cannot express --reshard-after-forward 2"):
        check_exportable(setup, kind=kind)
    check_exportable(TrainingSetup(model="tiny-llama", method="fsdp", gpus=4), kind=kind)   # without N: exportable
