"""`llmem` command line: estimate, trace, measure, validate, plan, models, gpus.

Every command takes --json. Bad input prints one line on stderr and exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from llmem.errors import LlmemError

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _training_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training set-up")
    g.add_argument("model", metavar="MODEL", help="catalog name, hub id, path to config.json, or a model folder")
    g.add_argument("--method", default=None, help="single, ddp (cdp), fsdp (zero3, adp), zero2, tp, fsdp+tp (dp+tp)")
    g.add_argument("--gpus", type=int, default=1, help="number of GPUs (default 1)")
    g.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: min(gpus, 8))")
    g.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (tp, fsdp+tp)")
    g.add_argument("--batch-size", type=int, default=1, help="per-GPU micro-batch (default 1)")
    g.add_argument("--seq-len", type=int, default=2048, help="tokens per sample (default 2048)")
    g.add_argument("--precision", default="bf16-mixed", help="fp32, bf16-mixed, fp16-mixed, bf16, fp16")
    g.add_argument("--optimizer", default="adamw",
                   help="adamw (foreach), adamw-fused, adamw-forloop, sgd, sgd-momentum, adafactor (torch, for-loop), "
                        "lion, adamw-8bit, paged-adamw-8bit (bitsandbytes' AdamW8bit / PagedAdamW8bit)")
    g.add_argument("--optimizer-in-backward", action="store_true",
                   help="step each parameter in its post-accumulate-grad hook and free its gradient (single GPU)")
    g.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing of every decoder layer")
    g.add_argument("--grad-ckpt-every", type=int, default=None, metavar="K",
                   help="checkpoint every K-th decoder layer (index %% K == 0); implies --grad-ckpt")
    g.add_argument("--attn", default="sdpa", help="sdpa, flash (flash_attention_2; fp16/bf16) or eager")
    g.add_argument("--fused-ce", action="store_true",
                   help="fused linear cross-entropy in chunks of tokens (no full fp32 logits)")
    g.add_argument("--offload-activations", action="store_true",
                   help="keep saved activations in pinned CPU memory between forward and backward")
    g.add_argument("--packing", action="store_true", help="samples packed into rows (position_ids restart)")
    g.add_argument("--gpu", default="A100-80GB", help="GPU type (see `llmem gpus`)")
    g.add_argument("--gpu-memory", default=None, help="GPU memory, e.g. 80GiB (overrides the catalog)")
    g.add_argument("--cuda-context", default=None, help="CUDA context size, e.g. 500MiB (overrides the assumption)")
    g.add_argument("--expandable-segments", action="store_true", help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments")
    g.add_argument("--offload-optimizer", action="store_true", help="optimizer states and update on the CPU")
    g.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank (base frozen); 0: full")
    g.add_argument("--lora-alpha", type=int, default=16, help="LoRA alpha (scaling; no effect on memory)")
    g.add_argument("--lora-targets", default="q_proj,v_proj", help="modules to adapt, comma-separated, or all-linear")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA dropout on the adapters' input (default 0)")
    g.add_argument("--peft-config", default=None, metavar="PATH",
                   help="adapter_config.json (or its folder) applied with peft: LoRA, DoRA, IA3, prompt/prefix tuning")
    g.add_argument("--trust-remote-code", action="store_true", help="let transformers run the model's own code")
    g.add_argument("--qlora", action="store_true",
                   help="frozen base in bitsandbytes' 4-bit NF4 (QLoRA); needs adapters (--lora-rank)")
    g.add_argument("--load-in-8bit", action="store_true",
                   help="frozen base in bitsandbytes' LLM.int8 (Linear8bitLt); needs adapters (--lora-rank)")
    g.add_argument("--no-double-quant", action="store_true",
                   help="--qlora without double quantisation (fp32 absmax per 64-block)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def setup_from_args(args: argparse.Namespace):
    from llmem.config import TrainingSetup
    from llmem.methods import canonical_method

    method = canonical_method(args.method) if args.method else ("single" if args.gpus == 1 else "fsdp")
    return TrainingSetup(
        model=args.model, method=method, gpus=args.gpus, gpus_per_node=args.gpus_per_node, tp=args.tp,
        batch_size=args.batch_size, seq_len=args.seq_len, precision=args.precision, optimizer=args.optimizer,
        grad_ckpt=args.grad_ckpt or args.grad_ckpt_every is not None,
        ckpt_every=1 if args.grad_ckpt_every is None else args.grad_ckpt_every, fused_ce=args.fused_ce,
        offload_activations=args.offload_activations, packing=args.packing, attn=args.attn, gpu=args.gpu, gpu_memory=args.gpu_memory,
        cuda_context=args.cuda_context, expandable_segments=args.expandable_segments,
        offload_optimizer=args.offload_optimizer, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
        lora_targets=args.lora_targets, lora_dropout=args.lora_dropout, peft_config=args.peft_config,
        trust_remote_code=args.trust_remote_code, optimizer_in_backward=args.optimizer_in_backward,
        quant_base=_quant_base(args), double_quant=not args.no_double_quant,
    )


def _quant_base(args: argparse.Namespace) -> str:
    from llmem.errors import LlmemError

    if args.qlora and args.load_in_8bit:
        raise LlmemError("--qlora and --load-in-8bit exclude each other: choose one quantised base")
    if args.no_double_quant and not args.qlora:
        raise LlmemError("--no-double-quant applies to --qlora only")
    return "nf4" if args.qlora else "int8" if args.load_in_8bit else "none"


def cmd_estimate(args: argparse.Namespace) -> int:
    from llmem.anatomy import load_anatomy
    from llmem.estimator import estimate
    from llmem.hardware import resolve_gpu
    from llmem.units import parse_bytes

    setup = setup_from_args(args)
    if args.engine == "paper":
        from llmem.paper import paper_estimate

        anatomy = load_anatomy(setup.model, setup.trust_remote_code)
        gpu = resolve_gpu(setup.gpu, setup.gpu_memory, setup.cuda_context)
        m_base = parse_bytes(args.m_base) if args.m_base else None
        result = paper_estimate(setup, anatomy, gpu, m_base_bytes=m_base)
    elif args.engine == "llmem":
        result = estimate(setup)
    else:
        raise LlmemError(f"unknown engine {args.engine!r}: choose llmem or paper")
    _emit(args, result)
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from llmem.tracer import plot_timeline, trace

    setup = setup_from_args(args)
    if args.json:
        result = trace(setup, iterations=args.iterations)
    else:
        from rich.console import Console

        with Console(stderr=True).status("tracing") as status:
            result = trace(setup, iterations=args.iterations, progress=lambda msg: status.update(f"trace: {msg}"))
    if args.plot:
        plot_timeline(result, args.plot)
    _emit(args, result)
    return 0


def cmd_measure(args: argparse.Namespace) -> int:
    from llmem.measure import measure

    if args.json:
        result = measure(setup_from_args(args), device=args.device, iterations=args.iterations)
    else:
        from rich.console import Console

        with Console(stderr=True).status("measuring"):
            result = measure(setup_from_args(args), device=args.device, iterations=args.iterations)
    _emit(args, result)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from llmem.validate import run_validation

    return run_validation(against=args.against, matrix=args.matrix, max_error_pct=args.max_error,
                          json_out=args.out, plot=args.plot, as_json=args.json, device=args.device)


def cmd_plan(args: argparse.Namespace) -> int:
    from llmem.planner import cli_plan

    return cli_plan(args)


def cmd_models(args: argparse.Namespace) -> int:
    from llmem import report
    from llmem.catalog import catalog

    rows = [{"id": e.hub_id, "aliases": list(e.aliases), "params": e.published_params} for e in catalog().values()]
    if args.json:
        report.print_json(rows)
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="bundled model configs")
    for col in ("model", "parameters", "aliases"):
        table.add_column(col, justify="right" if col == "parameters" else "left")
    for r in rows:
        table.add_row(r["id"], f"{r['params'] / 1e9:.2f} B", ", ".join(r["aliases"]))
    Console().print(table)
    return 0


def cmd_gpus(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from llmem import report
    from llmem.hardware import GPU_CATALOG
    from llmem.units import format_bytes

    rows = [asdict(g) for g in GPU_CATALOG.values()]
    if args.json:
        report.print_json(rows)
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="GPU catalog (CUDA context is an assumption; override with --cuda-context)")
    for col in ("gpu", "memory", "CUDA context", "bf16 TFLOP/s", "link GB/s", "memory GB/s"):
        table.add_column(col)
    for g in GPU_CATALOG.values():
        table.add_row(g.name, format_bytes(g.memory_bytes), format_bytes(g.cuda_context_bytes),
                      f"{g.bf16_tflops:g}", f"{g.link_gbps:g}", f"{g.memory_gbps:g}")
    Console().print(table)
    return 0


def _emit(args: argparse.Namespace, result) -> None:
    from llmem import report

    if args.json:
        report.print_json(result.to_dict())
    else:
        report.print_memory(result)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmem", description="GPU memory of fine-tuning an LLM, per GPU and method")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("estimate", help="fast analytic estimate of per-GPU peak memory")
    _training_options(p)
    p.add_argument("--engine", default="llmem", help="llmem (PyTorch-native, default) or paper (LLMem's equations)")
    p.add_argument("--m-base", default=None, help="paper engine: memory in use before training, e.g. 700MiB")
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("trace", help="run the real step on fake tensors through a model of the CUDA allocator")
    _training_options(p)
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write the memory timeline as a PNG")
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("measure", help="run the real step on a real device (GPU if present, else CPU)")
    _training_options(p)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--iterations", type=int, default=2)
    p.set_defaults(func=cmd_measure)

    p = sub.add_parser("validate", help="compare estimate against trace or measure over a matrix of set-ups")
    p.add_argument("--against", default="trace", choices=("trace", "measure"))
    p.add_argument("--matrix", default="ci", help="ci, large, or gpu (see llmem/validate.py)")
    p.add_argument("--max-error", type=float, default=2.0, help="fail when any error exceeds this percentage")
    p.add_argument("--out", default=None, metavar="FILE.json", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write estimate vs truth as a PNG")
    p.add_argument("--device", default=None, help="measure: cuda or cpu")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("plan", help="largest batch per method, a time model, and a recommendation")
    from llmem.planner import add_plan_options

    add_plan_options(p, _training_options)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("models", help="list the bundled model catalog")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("gpus", help="list the GPU catalog")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_gpus)
    return parser


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except LlmemError as exc:
        print(f"llmem: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("llmem: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
