"""A small training script the `llmem plan --export torchrun` script launches (`torchrun ... -m
llmem.runtime.train_script`): the planned layout, micro-batch, accumulation, precision, optimizer and checkpointing
applied to a transformers causal LM with PyTorch's own APIs, as the trace applies them (llmem.runtime.distributed):
DDP, FSDP2 `fully_shard` per decoder layer and the root, `parallelize_module` with the family's tensor-parallel
plan, and FSDP2 over the dp dimension of a (dp, tp) mesh.

The weights are random (the config built on the meta device, sharded, then materialised on each rank's device and
initialised the transformers way) unless --pretrained loads the checkpoint (on each rank's CPU before sharding);
the tokens are random unless --data names a .npy file of token ids (windows of seq-len drawn from it). It prints
the loss, tokens/s and the device's peak memory per step: a run to check the plan on the real GPUs, and a start for
one's own training loop. On a machine without CUDA it runs on the CPU with gloo (the tests do).

This module imports torch only inside its functions: the exporter reads its flags (`build_parser`) without it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from llmem.errors import LlmemError
from llmem.setup.methods import METHODS
from llmem.setup.optimizers import OPTIMIZERS
from llmem.setup.precision import PRECISIONS

MODULE = "llmem.runtime.train_script"
# the optimizers it builds: the registry's Adam(W) rows (the ones every export carries), as the trace builds them
SCRIPT_OPTIMIZERS = tuple(name for name, spec in OPTIMIZERS.items() if spec.adam)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}",
                                description="Train a transformers causal LM on the layout llmem planned.")
    p.add_argument("--model", required=True, help="catalog name, hub id, path to config.json or a model folder")
    p.add_argument("--method", required=True, choices=tuple(METHODS), help="the planned method")
    p.add_argument("--dp", type=int, required=True, help="data-parallel degree")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--dp-replicate", type=int, default=1,
                   help="HSDP: the dp ranks as this many replicas of FSDP2 shards (default 1)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="tp: SequenceParallel on the norms and the residual stream (torchtitan's plan)")
    p.add_argument("--loss-parallel", action="store_true",
                   help="tp: the loss on vocab-sharded logits under torch's loss_parallel()")
    p.add_argument("--micro-batch-size", type=int, required=True, help="samples per GPU per micro-batch")
    p.add_argument("--gradient-accumulation-steps", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sample")
    p.add_argument("--precision", default="bf16-mixed", choices=tuple(PRECISIONS))
    p.add_argument("--optimizer", default="adamw", choices=SCRIPT_OPTIMIZERS)
    p.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing of every decoder layer")
    p.add_argument("--offload-optimizer", action="store_true",
                   help="FSDP2's CPUOffloadPolicy (parameters, gradients and optimizer states on the CPU)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps to run (default 10)")
    p.add_argument("--lr", type=float, default=1e-5, help="learning rate (default 1e-5)")
    p.add_argument("--data", default=None, help="a .npy file of token ids (default: random tokens)")
    p.add_argument("--pretrained", action="store_true", help="load the checkpoint's weights (default: random init)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: min(world, 8))")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p


def _check(args: argparse.Namespace, world: int) -> None:
    for flag in ("dp", "tp", "micro_batch_size", "gradient_accumulation_steps", "seq_len", "steps"):
        if getattr(args, flag) < 1:
            raise LlmemError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.dp * args.tp != world:
        raise LlmemError(f"--dp {args.dp} x --tp {args.tp} = {args.dp * args.tp} GPUs, but this run has {world} "
                         "process(es): launch it with torchrun --nproc_per_node (x --nnodes) = dp x tp")
    spec = METHODS[args.method]
    if (args.sequence_parallel or args.loss_parallel) and not spec.has_tp:
        raise LlmemError(f"--sequence-parallel / --loss-parallel are styles of tensor parallelism: {args.method} "
                         "has none")
    if args.offload_optimizer and not spec.shards_model_states:
        raise LlmemError(f"--offload-optimizer is FSDP2's CPUOffloadPolicy here and {args.method} does not shard "
                         "with FSDP2: use DeepSpeed's ZeRO-Offload (llmem plan --export deepspeed)")


def _loss_parallel(args: argparse.Namespace):
    """torch's loss_parallel() around forward and backward (cross-entropy on the vocab-sharded logits)."""
    import contextlib

    if not args.loss_parallel:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _tokens(args: argparse.Namespace, vocab: int, device, generator):
    """One micro-batch of token ids [micro-batch, seq-len] (the model shifts them into its labels)."""
    import torch

    n, seq = args.micro_batch_size, args.seq_len
    if args.data is None:
        ids = torch.randint(0, vocab, (n, seq), generator=generator)
    else:
        import numpy as np

        data = np.load(args.data, mmap_mode="r")
        if data.ndim != 1 or len(data) < seq:
            raise LlmemError(f"--data {args.data}: need a 1-D array of at least --seq-len ({seq}) token ids, got "
                             f"shape {data.shape}")
        starts = torch.randint(0, len(data) - seq + 1, (n,), generator=generator).tolist()
        ids = torch.stack([torch.from_numpy(np.asarray(data[s:s + seq], dtype=np.int64)) for s in starts])
    return ids.to(device)


def _build(args: argparse.Namespace, layout, mesh, device):
    """The model, checkpointed, tensor-parallel and FSDP2-sharded as the layout's method row says, with its
    weights materialised on `device`."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from llmem.runtime.build import enable_checkpointing, init_real_weights, meta_model_for, tie_if_needed
    from llmem.runtime.distributed import apply_tensor_parallel, fsdp_submesh, layer_list, tp_submesh
    from llmem.setup.training import TrainingSetup

    precision = PRECISIONS[args.precision]
    setup = TrainingSetup(model=args.model, trust_remote_code=args.trust_remote_code, precision=args.precision)
    if args.pretrained:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32,
                                                     trust_remote_code=args.trust_remote_code)
        model.config.use_cache = False
        model.train()
    else:
        model = meta_model_for(setup)
    if not precision.mixed and precision.low_precision:
        model.to(getattr(torch, precision.compute_dtype))        # pure bf16 / fp16 parameters
    if args.grad_ckpt:
        enable_checkpointing(model)
    spec = layout.spec
    if spec.has_tp:
        apply_tensor_parallel(model, tp_submesh(layout, mesh), layout.tp, args.sequence_parallel, args.loss_parallel)
    if spec.shards_model_states:
        kw: dict = {"mesh": fsdp_submesh(layout, mesh), "reshard_after_forward": spec.reshard_after_forward}
        if precision.mixed:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, precision.compute_dtype),
                                                   reduce_dtype=torch.float32)
        if args.offload_optimizer:
            kw["offload_policy"] = CPUOffloadPolicy()
        for layer in layer_list(model):
            fully_shard(layer, **kw)
        fully_shard(model, **{**kw, "reshard_after_forward": None if spec.reshard_after_forward else False})
    if not args.pretrained:
        model.to_empty(device="cpu" if args.offload_optimizer else device)
        with torch.no_grad():
            init_real_weights(model)
        tie_if_needed(model)
    elif not spec.shards_model_states:
        model.to(device)
    if spec.gradient_buckets:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except LlmemError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _device(local_rank: int):
    """This rank's GPU (made the current one), or the CPU on a machine without CUDA."""
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return device


def _layout(args: argparse.Namespace, world: int):
    """The method's layout on `world` GPUs, checked against --dp."""
    from llmem.setup.layout import resolve_layout

    spec = METHODS[args.method]
    layout = resolve_layout(args.method, world, args.tp if spec.has_tp else None, args.gpus_per_node, 0, 0,
                            args.dp_replicate)
    if layout.dp != args.dp:
        raise LlmemError(f"{args.method} on {world} GPU(s) with --tp {args.tp} has dp {layout.dp}, not --dp "
                         f"{args.dp}")
    return layout


def _scaler(args: argparse.Namespace, device):
    """fp16 mixed precision's loss scaler (FSDP2's sharded one where the method shards); None otherwise."""
    import torch

    precision = PRECISIONS[args.precision]
    if not (precision.mixed and getattr(torch, precision.compute_dtype) == torch.float16):
        return None
    if METHODS[args.method].shards_model_states:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)


def _micro_batch(args: argparse.Namespace, model, vocab: int, device, generator, scaler, last: bool) -> float:
    """Forward and backward of one micro-batch of fresh tokens, the gradients synchronised on the last one; its loss."""
    import contextlib

    import torch

    spec, precision = METHODS[args.method], PRECISIONS[args.precision]
    sync = contextlib.nullcontext()
    if spec.gradient_buckets and not last:
        sync = model.no_sync()
    elif spec.shards_model_states:
        model.set_requires_gradient_sync(last)
    ids = _tokens(args, vocab, device, generator)
    with sync, _loss_parallel(args):
        with torch.autocast(device.type, dtype=getattr(torch, precision.compute_dtype),
                            enabled=precision.mixed and spec.autocast_under_mixed):
            loss = model(input_ids=ids, labels=ids).loss / args.gradient_accumulation_steps
        (scaler.scale(loss) if scaler else loss).backward()
    return float(loss.detach())


def _train(args: argparse.Namespace, model, optimizer, scaler, layout, device, rank: int) -> list[float]:
    """The optimizer steps, each over the accumulated micro-batches; rank 0 prints loss, tokens/s and peaks."""
    import torch

    # each data-parallel rank its own tokens; the ranks of one tensor-parallel group the same ones
    data_rank = rank // layout.tp if METHODS[args.method].has_tp else rank
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + data_rank + 1)
    vocab = model.module.config.vocab_size if hasattr(model, "module") else model.config.vocab_size
    losses = []
    tokens = args.micro_batch_size * args.seq_len * args.gradient_accumulation_steps * layout.dp
    for step in range(args.steps):
        t0 = time.perf_counter()
        total = 0.0
        for micro in range(args.gradient_accumulation_steps):
            last = micro == args.gradient_accumulation_steps - 1
            total += _micro_batch(args, model, vocab, device, generator, scaler, last)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        if rank == 0:
            dt = time.perf_counter() - t0
            peak = f", peak allocated {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB, reserved " \
                   f"{torch.cuda.max_memory_reserved(device) / 2**30:.2f} GiB" if device.type == "cuda" else ""
            print(f"step {step + 1}/{args.steps}: loss {total:.4f}, {tokens / dt:,.0f} tokens/s{peak}", flush=True)
    return losses


def run(args: argparse.Namespace) -> list[float]:
    """Train `args.steps` steps; the losses of rank 0 (every rank returns its own)."""
    import torch
    import torch.distributed as dist

    from llmem.runtime.distributed import device_mesh
    from llmem.runtime.optimizers import make_optimizer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    _check(args, world)
    device = _device(local_rank)
    layout = _layout(args, world)
    started = world > 1 and not dist.is_initialized()
    if started:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        torch.manual_seed(args.seed)                       # the same initial weights on every rank
        mesh = device_mesh(layout, device.type)
        model = _build(args, layout, mesh, device)
        optimizer = make_optimizer(model, args.optimizer)
        for group in optimizer.param_groups:
            group["lr"] = args.lr
        return _train(args, model, optimizer, _scaler(args, device), layout, device, rank)
    finally:
        if started:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
