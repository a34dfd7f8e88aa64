"""`llmem trace` of the job's loading phase: the model loaded and placed as each path's framework code does it
(transformers 5.25, accelerate 1.16, torch 2.13), run on fake tensors in a run of its own before the step's (rank 0
on the fake process group), its device allocations in a ledger of their own under the "load" phase and its host
tensors tallied apart (llmem.runtime.host_copies).

from_pretrained itself is not run (no checkpoint is read): the model is built on the meta device as from_pretrained
builds it, and each of its tensors made where from_pretrained's device map puts it, in the dtype the step keeps it:
- cpu, replicated: every tensor on the host, then Trainer._move_model_to_device's real `model.to(device)`;
- device-map: every tensor made on the GPU;
- cpu, FSDP2: every tensor on the host, then accelerate's real fsdp2_prepare_model (the plugin's transformer-based
  auto wrap, the embedding and tail units, the root; its original_sd kept until it returns): fully_shard's
  _move_states_to_device moves each unit's tensors to the device whole before FSDPParam keeps this rank's shard;
- meta-init (torchtitan): the model kept on meta, fully_shard per decoder layer and the root on meta, the real
  `to_empty(device)`, then a sharded load into this rank's shards: torch.distributed.checkpoint's real load with a
  storage reader whose reads are host tensors of each item's shape (its FileSystemReader reads the bytes into a host
  tensor, then copies it into the target), then set_model_state_dict.
Host bytes are one rank's tensors times the node's ranks that hold the same (every rank loads on its host).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import torch
from torch import nn

from llmem.result import JobPhase
from llmem.runtime.build import materialize
from llmem.runtime.distributed import (
    apply_fsdp,
    device_mesh,
    device_mesh_outside_fake,
    dtensor_propagation_untracked,
    fake_process_group,
    fsdp_submesh,
)
from llmem.runtime.host_copies import CUDA, host_and_device, host_materialize
from llmem.runtime.ledger import PHASE_CODES, Ledger, TracingFakeMode, tracking
from llmem.runtime.patches import (
    accelerate_logging_without_state,
    collectives_waited_in_place,
    patched,
    quiet,
)
from llmem.runtime.replay import phase_tensor_peak
from llmem.setup.job_phases import FSDP2, REPLICATED, load_path, phase_family

LOAD_PHASE = "load"


@contextlib.contextmanager
def _states_moved_to_cuda() -> Iterator[None]:
    """fully_shard's _move_states_to_device given the GPU (the fake mesh's device is the host's type): each tensor
    of a host unit copied to the device (`tensor.data = tensor.to(device)`)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    move = _fsdp_init._move_states_to_device
    with patched(_fsdp_init, "_move_states_to_device", lambda params, buffers, device: move(params, buffers, CUDA)):
        yield


def trainer_moves_to_device(model: nn.Module, ledger: Ledger, ctx) -> nn.Module:
    """from_pretrained onto the host, then Trainer._move_model_to_device: model.to(args.device)."""
    host_materialize(model, ledger)
    return model.to(CUDA)


def device_map_load(model: nn.Module, ledger: Ledger, ctx) -> nn.Module:
    """from_pretrained(device_map=...): each tensor made on the GPU (the checkpoint's pages are the OS's)."""
    materialize(model, CUDA)
    return model


def accelerate_fsdp2_prepare(model: nn.Module, ledger: Ledger, ctx) -> nn.Module:
    """from_pretrained onto the host, then accelerate's fsdp2_prepare_model (no cpu_ram_efficient_loading, its
    default) with the plugin HF Trainer builds for FSDP2 (transformer-based wrap, the set-up's mixed precision)."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.fsdp import MixedPrecisionPolicy

    setup = ctx.setup
    host_materialize(model, ledger)
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, setup.compute_dtype), reduce_dtype=torch.float32) \
        if setup.mixed else None
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            reshard_after_forward=True, mixed_precision_policy=mp,
                                            cpu_ram_efficient_loading=False)
    dims = ("fsdp",)
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh={dims: ctx.mesh},
                                  parallelism_config=SimpleNamespace(fsdp_dim_names=dims),
                                  mixed_precision=setup.compute_dtype if setup.mixed else "no",
                                  is_main_process=True, device=CUDA)
    with _states_moved_to_cuda(), accelerate_logging_without_state():
        return fsdp2_prepare_model(accelerator, model)


def torchtitan_meta_init(model: nn.Module, ledger: Ledger, ctx) -> nn.Module:
    """torchtitan: fully_shard on meta, model.to_empty(device), then its checkpoint's sharded load (dcp.load into
    the sharded state dict, set_model_state_dict)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from llmem.runtime.dcp_reads import load_sharded

    with unset_fake_temporarily():        # fully_shard on the meta device (no tensor made)
        apply_fsdp(model, ctx.mesh, ctx.setup, reshard=True, region=ledger.region)
    model.to_empty(device=CUDA)
    state_dict = get_model_state_dict(model)
    load_sharded(state_dict)
    set_model_state_dict(model, state_dict)
    return model


# (loading path, phase family) -> what runs (llmem.setup.job_phases' rows); on each, every rank of a node holds the
# host tensors rank 0 holds
LOAD_RUNS: dict[tuple[str, str], Callable] = {
    ("cpu", REPLICATED): trainer_moves_to_device, ("device-map", REPLICATED): device_map_load,
    ("cpu", FSDP2): accelerate_fsdp2_prepare, ("meta-init", FSDP2): torchtitan_meta_init,
}


def phases_untraced(setup) -> str | None:
    """Why the trace runs neither the loading nor the saving code for the set-up (None: it runs them where a path
    is in LOAD_RUNS / SAVE_RUNS): set-ups whose model or trainer the phases' code paths were not checked against."""
    from llmem.model.resolved import resolve
    from llmem.model.vision import vision_spec

    for why, applies in (("torch.compile", setup.compile), ("float8 training", setup.float8 != "none"),
                         (f"--objective {setup.objective} (TRL's trainer)", setup.objective_spec.runs_trainer),
                         ("offloading to the host", setup.offload_param or setup.steps_on_host),
                         ("--shard-embeddings", setup.shard_embeddings),
                         ("--peft-config (adapter types other than LoRA)", bool(setup.peft_config))):
        if applies:
            return why
    if vision_spec(resolve(setup).anatomy.model_type) is not None:
        return "a vision-language model"
    return None


def load_run(setup) -> Callable | None:
    """What the trace runs for the set-up's loading path (None: not traced)."""
    family, row = phase_family(setup), load_path(setup)
    if family is None or row is None or phases_untraced(setup) is not None:
        return None
    return LOAD_RUNS.get((row.name, family))


def load_phases(setup, progress: Callable[[str], None] | None = None) -> list[JobPhase]:
    """The loading phase traced in a run of its own ([] where the set-up's path is not traced)."""
    from llmem.model.resolved import resolve
    from llmem.runtime.step import meta_model_stage

    run = load_run(setup)
    if run is None:
        return []
    if progress:
        progress("loading the model")
    resolved = resolve(setup)
    layout = resolved.layout
    ledger, fake_mode = Ledger(), TracingFakeMode(allow_non_fake_inputs=True)   # the meta model's tensors
    with contextlib.ExitStack() as stack:
        stack.enter_context(quiet())
        model, _, _ = meta_model_stage(setup, resolved, True, 0)
        mesh = None
        if layout.world_size > 1:
            stack.enter_context(fake_process_group(layout.world_size))
        if resolved.method.shards_model_states:
            stack.enter_context(dtensor_propagation_untracked())
            stack.enter_context(device_mesh_outside_fake())
            mesh = fsdp_submesh(layout, device_mesh(layout, "cpu"))
        stack.enter_context(fake_mode)
        stack.enter_context(tracking(ledger, fake_mode, real=False))
        ledger.phase = PHASE_CODES[LOAD_PHASE]
        with collectives_waited_in_place(), host_and_device(ledger):
            model = run(model, ledger, SimpleNamespace(setup=setup, mesh=mesh))
        device, host = phase_tensor_peak(ledger, LOAD_PHASE), ledger.host_peaks.get(ledger.phase, 0)
        ledger.enabled = False
        del model
    ranks = min(layout.gpus_per_node, layout.world_size)
    what = "traced: " + " ".join((run.__doc__ or load_path(setup).summary).split())
    return [JobPhase(LOAD_PHASE, load_path(setup).name, device, ranks * host, what)]
