"""--compile: each decoder layer through torch.compile's real pipeline, on fake tensors.

torchtune (`training.compile_model`) and torchtitan (`apply_compile`) compile every decoder layer on its own
(`layer.compile()`, fullgraph in torchtitan), after activation checkpointing wraps it: torchtune compiles the layer
inside its checkpoint wrapper (the checkpoint replays the compiled layer), torchtitan the wrapper itself (the
checkpoint inside the graph); llmem runs torchtune's order. What that changes in memory is
decided before any kernel runs: dynamo captures the layer's graph, AOTAutograd traces forward and backward jointly,
inductor's decomposition table rewrites it, and the min-cut partitioner (torch/_functorch/partitioners.py,
`min_cut_rematerialization_partition`) chooses what the forward saves for backward - recomputing cheap pointwise ops
in backward rather than saving their outputs. All of that runs here, as inductor runs it (`compile_fx` with its own
decompositions and partitioner), on the step's fake tensors: only the last stage, inductor's code generation, is
replaced by running each partitioned graph op by op (`_graphs_op_by_op`), so every tensor the forward saves is the
real one, with its real size and lifetime. On real tensors (benchmarks/compile_gpu.py) inductor runs whole,
kernels included; `llmem measure` refuses --compile (its op tracker is a dispatch mode dynamo refuses).

Known limitations: inductor's generated kernels fuse chains of pointwise ops, whose intermediates then never exist,
and plan their buffers' reuse; run op by op, each op's output is a tensor of its own until its last use (FX frees it
there). The saved tensors are exact; the transients inside a layer's forward and backward are an upper bound of the
compiled ones. The loss is compiled only as torchtune compiles its chunked one (compile_loss), and laid out as
inductor's generated code allocates it (llmem.runtime.compiled_loss); torchtitan's and torchtune's other losses run
eagerly. The estimate learns a compiled layer at the micro-batch's own shape (the partitioner's choices change with
sizes) and reads it as one block, its backward one transient: its allocated peak is the trace's, its reserved one
can be several per cent over at larger widths (+8.8 % on a 4-layer, 1024-wide Llama at 2 x 2048 in bf16; within 2 %
on the CI rows). Selective checkpointing, Liger's Functions and DeepSpeed's engine around a
compiled layer are refused (llmem.setup.support's COMPILE row). Offloaded activations are not: AOTAutograd does not
trace ambient saved-tensor hooks (torch/_functorch/aot_autograd.py, "Deferring tensor pack/unpack hooks until
runtime"), so torchtune's OffloadActivations (llmem.runtime.offload) packs each tensor the compiled layer's autograd
Function saves (runtime_wrappers.py, ctx.save_for_backward) as it packs an eager op's, under checkpointing the
layer's input only (the checkpoint's own hooks take the recompute's). Nor is torchao's NF4 base (torchtune's QLoRA):
the emulated LinearNF4 (llmem.runtime.quant_kernels) is get_original_weight op for op, which dynamo traces into the
layer's graph as it traces NF4Tensor's `to`; the partitioner keeps each base linear's dequantised weight for
backward (tests/runtime/test_compile.py), one layer's worth at a time under checkpointing.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from llmem.runtime.distributed import layer_list


def _graphs_op_by_op(gm, example_inputs, **_kwargs):
    """Inductor's inner compile, replaced: the partitioned graph runs as FX's Python code, op by op, in the boxed
    calling convention compile_fx expects (torch._dynamo.backends.debugging's boxed_nop): the code clears its
    argument list once read and drops each value after its last use, so the backward frees each saved tensor as
    it is consumed (AOTAutograd clears the node's saved tensors before the call, maybe_clear_saved_tensors), as
    inductor's generated code does."""
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()

    def run(args):
        return gm.forward(args)

    run._boxed_call = True
    return run


def _inductor_partitioned(gm, example_inputs):
    """torch.compile's backend: inductor's compile_fx (its decompositions, AOTAutograd, the min-cut partitioner)
    up to code generation."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, inner_compile=_graphs_op_by_op)


def compile_layers(model: nn.Module, fake: bool = True):
    """Compile each decoder layer's forward in place (fullgraph: a graph break would split what the partitioner
    sees); its checkpointing, where on, stays outside the compiled code and replays it (`_checkpointed`). On fake
    tensors the partitioned graphs run op by op; on real ones (benchmarks/compile_gpu.py) inductor generates and
    runs its kernels.
    Returns dynamo's settings for the step (a context manager, `_one_graph_for_every_layer`)."""
    import torch._dynamo

    torch._dynamo.reset()             # no graphs kept from an earlier step of another shape
    backend = _inductor_partitioned if fake else "inductor"
    layers = layer_list(model)
    compiled: dict[type, object] = {}     # one compiled forward per layer class, the layer passed in as an input
    for layer in layers:
        cls = type(layer)
        if cls not in compiled:
            compiled[cls] = torch.compile(_unchecked_forward(cls.forward), backend=backend, fullgraph=True)
        layer.forward = _checkpointed(layer, functools.partial(compiled[cls], layer))
    return _one_graph_for_every_layer(len(layers))


def compile_loss(loss_fn, fake: bool = True) -> None:
    """torchtune's training.compile_loss for CEWithChunkedOutputLoss (--compile with --output-chunks): its
    compute_cross_entropy (one chunk's upcast and cross-entropy) compiled, the chunking left eager. On fake tensors
    it allocates what inductor's generated code for it allocates (llmem.runtime.compiled_loss: one fused kernel
    each way, no [tokens, vocab] fp32 tensor), where the layers' graphs run op by op."""
    if fake:
        from llmem.runtime.compiled_loss import compiled_chunk_loss

        loss_fn.compute_cross_entropy = compiled_chunk_loss(loss_fn)
    else:
        loss_fn.compute_cross_entropy = torch.compile(loss_fn.compute_cross_entropy, backend="inductor")


def _one_graph_for_every_layer(layers: int):
    """Dynamo's settings while the step runs. An int attribute of a module is a constant to dynamo: HF's layers
    read their `layer_idx` (the KV cache's index), so each layer would be a graph of its own, and past
    recompile_limit (8) a hard failure under fullgraph. As a symbolic int (allow_unspec_int_on_nn_module, the
    guard's own hint) it is one graph for all; the limit is raised to the depth in case another attribute differs
    by layer (each layer then compiles alone, the same memory)."""
    import torch._dynamo

    return torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True, recompile_limit=max(8, layers + 8),
                                      accumulated_recompile_limit=max(256, 2 * layers + 8))


def _unchecked_forward(forward):
    """The layer class's forward without transformers' checkpointing wrapper (GradientCheckpointingLayer wraps
    `forward` in `forward_with_checkpointing`, functools.wraps keeping the original as __wrapped__)."""
    if forward.__code__.co_name == "forward_with_checkpointing":
        return forward.__wrapped__
    return forward


def _checkpointed(layer: nn.Module, compiled):
    """The layer's forward: its compiled forward, inside the layer's checkpoint when transformers' wrapper would
    take one (torchtune's order: the checkpoint wrapper outside, the compiled layer inside)."""
    def forward(*args, **kwargs):
        if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False     # as transformers' wrapper: no cache under checkpointing
            return layer._gradient_checkpointing_func(functools.partial(compiled, **kwargs), *args)
        return compiled(*args, **kwargs)

    return forward
