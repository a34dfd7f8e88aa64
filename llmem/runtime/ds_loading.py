"""`llmem trace` of ZeRO-3's zero-init loading (HF's DeepSpeed config made before from_pretrained), in a run of its
own on fake tensors under DeepSpeed's CPU accelerator as llmem.runtime.deepspeed runs the step (rank 0 on the fake
process group), its device allocations under the ledger's "load" phase and its host tensors tallied apart.

What runs for real (transformers 5.25, DeepSpeed 0.19): with transformers' HfDeepSpeedConfig set,
`AutoModelForCausalLM.from_config` (PreTrainedModel._from_config: no_init_weights, deepspeed.zero.Init, as
from_pretrained builds the model under ZeRO-3: each module's parameters partitioned as it is built), then
transformers' _load_state_dict_into_zero3_model (GatheredParameters over each module's own parameters with
modifier_rank=0, rank 0's _load_from_state_dict copying the checkpoint's tensors in, then partitioned again).
What is emulated: the checkpoint rank 0 has read, host tensors of each parameter's shape in the compute dtype (the
safetensors reads are not run).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from llmem.result import JobPhase
from llmem.runtime.host_copies import host_and_device
from llmem.runtime.ledger import HOST, PHASE_CODES, Ledger, TracingFakeMode, tracking
from llmem.runtime.patches import quiet
from llmem.runtime.replay import phase_tensor_peak
from llmem.setup.job_phases import DS_ZERO3, load_path, phase_family

LOAD_PHASE = "load"
DS_LOAD_RUNS = frozenset({("zero-init", DS_ZERO3)})    # (loading path, phase family) traced here


def zero_init_traced(setup) -> bool:
    """Whether the trace runs the set-up's loading path here: zero-init under ZeRO-3, a set-up whose phases the
    trace runs (llmem.runtime.loading.phases_untraced), no adapters (peft's wrapping comes after from_pretrained)."""
    from llmem.runtime.loading import phases_untraced

    row = load_path(setup)
    return (row is not None and (row.name, phase_family(setup)) in DS_LOAD_RUNS and not setup.peft
            and phases_untraced(setup) is None)


def _checkpoint_on_host(model, ledger: Ledger, dtype: torch.dtype) -> dict:
    """Rank 0's checkpoint: a host tensor of every parameter's full shape (ZeRO-3's ds_shape) in `dtype`."""
    with ledger.region(HOST):
        return {name: torch.empty(tuple(getattr(p, "ds_shape", p.shape)), dtype=dtype, device="cpu")
                for name, p in model.named_parameters()}


def zero_init_load(setup, progress: Callable[[str], None] | None = None) -> list[JobPhase]:
    """The zero-init loading phase traced in a run of its own ([] where not traced here)."""
    from deepspeed import comm as deepspeed_comm
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import _load_state_dict_into_zero3_model

    from llmem.model.config import resolve_config, training_config
    from llmem.model.resolved import resolve
    from llmem.runtime.deepspeed import (
        cpu_accelerator,
        deepspeed_patches,
        ds_environment,
        fresh_comm_state,
        hf_deepspeed_config,
    )
    from llmem.runtime.distributed import fake_process_group
    from llmem.setup.gpus import resolve_gpu

    if not zero_init_traced(setup):
        return []
    if progress:
        progress("loading the model (zero.Init)")
    resolved = resolve(setup)
    layout = resolved.layout
    gpu = resolve_gpu(setup.gpu, setup.gpu_memory, setup.cuda_context)
    _, cfg = resolve_config(setup.model, setup.trust_remote_code)
    cfg = training_config(cfg)
    ledger, fake_mode = Ledger(), TracingFakeMode()
    dtype = getattr(torch, setup.compute_dtype)
    with contextlib.ExitStack() as stack:
        stack.enter_context(quiet())
        stack.enter_context(fake_process_group(layout.world_size))
        stack.enter_context(ds_environment(layout.world_size))
        accelerator = stack.enter_context(cpu_accelerator())
        stack.enter_context(fresh_comm_state())
        stack.enter_context(deepspeed_patches(ledger, accelerator, gpu.memory_bytes, True))
        stack.enter_context(hf_deepspeed_config(setup, 3, resolved.anatomy.hidden_size, layout.dp))
        deepspeed_comm.init_distributed(dist_backend=accelerator.communication_backend_name(), verbose=False,
                                        dist_init_required=False)    # deepspeed.initialize's, over the fake group
        stack.enter_context(fake_mode)
        stack.enter_context(tracking(ledger, fake_mode, real=False))
        ledger.phase = PHASE_CODES[LOAD_PHASE]
        with host_and_device(ledger, device_named_cpu=True):
            model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=setup.trust_remote_code, dtype=dtype)
            checkpoint = _checkpoint_on_host(model, ledger, dtype)
            _load_state_dict_into_zero3_model(model, checkpoint)
            del checkpoint
        device, host = phase_tensor_peak(ledger, LOAD_PHASE), ledger.host_peaks.get(ledger.phase, 0)
        ledger.enabled = False
        del model
    what = " ".join((__doc__ or "").split("What runs for real")[1].split("What is emulated")[0].split())
    return [JobPhase(LOAD_PHASE, load_path(setup).name, device, host, f"traced{what}")]
