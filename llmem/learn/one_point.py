"""One point of the learning: the real step of the shallow copy run once on fake tensors, each allocation recorded
unrounded with the module that made it, the backward stopped once the layer read is done."""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode

from llmem.errors import LlmemError, first_line
from llmem.learn.points import (
    BACKWARD,
    FORWARD,
    READ_LAYER,
    LearnError,
    Reading,
    VisionReading,
    layer_of,
    unit_of,
)
from llmem.learn.unshare import unshare_layer
from llmem.model.families import decoder_layers
from llmem.model.sharding import MATMUL_KINDS
from llmem.model.vision import vision_modules, vision_root, vision_spec
from llmem.runtime.ledger import Ledger, TracingFakeMode, tracking
from llmem.runtime.selective_ac import OP_SAC_SAVE_LIST
from llmem.runtime.step import StepHooks, prepared_step


@contextlib.contextmanager
def quiet_fake_tensor_log():
    """A failed op on fake tensors is logged with its traceback by torch (fake_tensor's logger) before it raises;
    learning catches it and gives the reason in one note."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


NODE_TAG = "llmem_module"
_MM = torch.ops.aten.mm.default


class ModuleLedger(Ledger):
    """The trace's ledger, unrounded, with backward allocations given the module whose forward made the autograd node
    running (the module tracker's own backward names go stale: its post-backward hooks wait on positional inputs,
    and transformers calls attention and decoder layers with keyword arguments only). The outputs of the ops
    torchtitan's selective checkpointing may save (llmem.runtime.selective_ac) are tagged with their op
    (`saved_ops`: key -> "mm" for aten.mm, the op's name for the others)."""

    def __init__(self) -> None:
        super().__init__(workspace_bytes=0, round_to=1)
        self.saved_ops: dict[int, str] = {}
        self._op: str | None = None

    def before_op(self, func, args) -> str | None:
        self._op = ("mm" if func is _MM else func.name()) if func in OP_SAC_SAVE_LIST else None
        return super().before_op(func, args)

    def track_outputs(self, out) -> None:
        op, self._op = self._op, None       # the op's own outputs only (not storages tracked later)
        first = self.next_key
        super().track_outputs(out)
        if op is not None:
            self.saved_ops.update(dict.fromkeys(range(first, self.next_key), op))

    def module_now(self) -> int:
        if self.phase == BACKWARD:
            node = torch._C._current_autograd_node()
            name = node.metadata.get(NODE_TAG) if node is not None else None
            if name is not None:
                idx = self.module_index.get(name)
                if idx is None:
                    idx = self.module_index[name] = len(self.module_names)
                    self.module_names.append(name)
                return idx
        return super().module_now()


class NodeModules(TorchFunctionMode):
    """In forward, tag each autograd node a torch call makes (and the nodes under it it made: autocast's casts, a
    parameter's AccumulateGrad at its first use) with the module running the call."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__()
        self.ledger = ledger

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.compiler.is_compiling():     # dynamo traces the mode: nothing of it in a compiled layer's graph
            return out
        led = self.ledger
        if led.phase == FORWARD and led.mod_tracker is not None and torch.is_grad_enabled():
            parents = led.mod_tracker.parents
            _tag_nodes(out, max(parents, key=len) if len(parents) > 1 else "-")
        return out


def _tag_nodes(out, name: str) -> None:
    """Tag the autograd nodes behind `out` not tagged yet with the module `name`."""
    for t in (out if isinstance(out, (tuple, list)) else (out,)):
        stack = [t.grad_fn if isinstance(t, torch.Tensor) else None]
        while stack:
            n = stack.pop()
            if n is None or NODE_TAG in n.metadata:
                continue
            n.metadata[NODE_TAG] = name
            stack.extend(f for f, _ in n.next_functions)


@contextlib.contextmanager
def compiled_layer_nodes(ledger: Ledger):
    """A compiled layer's graph is one autograd node that no torch call inside the mode made (dynamo calls it
    directly; llmem.runtime.compile): tagged with the layer once its forward returns."""
    def tag(module, args, out):
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return
        if ledger.phase == FORWARD and ledger.mod_tracker is not None:
            _tag_nodes(out, ledger.mod_tracker._get_mod_name(module))   # the tracker's name for it (its FQN)

    handle = torch.nn.modules.module.register_module_forward_hook(tag)
    try:
        yield
    finally:
        handle.remove()


def run_point(setup, vision_checkpointing: bool = False) -> Reading:
    """One training step of `setup` on fake tensors, its allocations recorded unrounded (`vision_checkpointing`: a
    vision-language model's encoder blocks checkpointed, its decoder layers not)."""
    ledger = ModuleLedger()
    fake_mode = TracingFakeMode()
    roles: list = []
    info: dict = {}
    try:
        with contextlib.ExitStack() as outer:
            outer.enter_context(quiet_fake_tensor_log())

            def start_tracking() -> None:
                roles.append(outer.enter_context(tracking(ledger, fake_mode, real=False)))
                outer.enter_context(NodeModules(ledger))
                if setup.compile:
                    outer.enter_context(compiled_layer_nodes(ledger))

            whole: list[bool] = []      # a vision-language model: the whole backward runs (its vision side's is read)

            def on_phase(ph: str, it: int) -> None:
                if whole and ph == "optimizer_step":
                    raise ReadLayerDone
                roles[0].on_phase(ph, it)

            hooks = StepHooks(on_phase=on_phase, region=ledger.region)
            with prepared_step(setup, fake=True, fake_mode=fake_mode, hooks=hooks,
                               before_model=start_tracking,
                               vision_checkpointing=vision_checkpointing) as step:
                roles[0].bind(step)
                info = model_info(step)
                stop_at: list[int] = []
                if info["vision"]:
                    whole.append(True)
                    handle = None
                    # where cuBLAS's workspace is made (the first matmul: the vision encoder's, before the decoder
                    # layers'), marked by a 1-byte allocation the vision side reads (llmem.learn.vision_read)
                    ledger.workspace_bytes, ledger.workspace_done = 1, False
                else:
                    handle = stop_after_read_layer(info["layer"], ledger, stop_at)
                info.pop("layer")
                try:
                    step.run(1)
                except ReadLayerDone:
                    pass
                if handle is not None:
                    handle.remove()
                if stop_at:        # the rest of the backward is not run (nor read: the graph is torn down)
                    del ledger.events[stop_at[0]:]
                # the gradients made so far, as the optimizer_step phase would label them (never reached)
                ledger.relabel([p.grad for p in step.model.parameters()], "gradients")
                # by storage, for a vision-language step's backward, read whole (llmem.learn.vision_read)
                grads = ({ledger.key_of(p.grad): name for name, p in step.model.named_parameters()
                          if p.grad is not None} if info["vision"] else {})
                ledger.enabled = False
                del step
    except LearnError:
        raise
    except LlmemError as exc:
        raise LearnError(f"the real step does not run on the copy: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - peft / transformers code on fake tensors: refused with the reason
        raise LearnError(f"the real step does not run on fake tensors ({type(exc).__name__}: "
                         f"{first_line(exc, 160)})") from None
    whole_step = without_loss(ledger, info["layers_path"], info["outer"])
    events = until_read_layer_done(whole_step, info["layers_path"])
    vision = VisionReading(info["vision"]["module"], info["layers_path"], whole_step,
                           {k: n for k, n in grads.items() if k is not None}, info["vision"]["modules"],
                           info["vision"]["blocks"], info["vision"]["after_embedding"]) if info["vision"] else None
    return Reading(events, info["layers_path"], info["units"], info["casts"], info["outer"], info["leaves"],
                   ledger.saved_ops, vision)


def without_loss(ledger: Ledger, layers_path: str, outer: tuple[str, ...]) -> list[tuple]:
    """Iteration 0's events, less the loss's own tensors (the causal LM's ops after the last layer in forward, and
    before the lm_head's backward): the schedule lays the loss out itself, and HF's loss allocates differently for
    one sample and several (the labels' shift is a view or a copy)."""
    names = ledger.module_names
    out = []
    loss: set[int] = set()
    seen_layer = head_reached = False
    for a, key, size, phase, it, mod, _stream in ledger.events:
        if it != 0:
            continue
        module = _fqn(names[mod]) if a else ""
        if a:
            if phase == FORWARD:
                seen_layer = seen_layer or layer_of(module, layers_path) is not None
                if seen_layer and module in outer:
                    loss.add(key)
                    continue
            elif phase == BACKWARD:
                head_reached = head_reached or module not in outer
                if not head_reached:
                    loss.add(key)
                    continue
        elif key in loss:
            continue
        out.append((a, key, size, phase, ledger.cat.get(key, "activations"), module))
    return frees_in_order(out)


def until_read_layer_done(events: list[tuple], layers_path: str) -> list[tuple]:
    """The events up to the end of layer READ_LAYER's backward: what comes after (the earlier layers' backward, the
    embedding's gradients, whose reduction over the batch differs for one sample) is not read."""
    seen = False
    for i, (a, _key, _size, phase, _cat, module) in enumerate(events):
        if not a or phase < BACKWARD:
            continue
        found = layer_of(module, layers_path)
        if found is not None and found[0] == READ_LAYER:
            seen = True
        elif seen and (found is None or found[0] < READ_LAYER) and module:
            return events[:i]
        if phase > BACKWARD:
            return events[:i]
    return events


def frees_in_order(events: list[tuple]) -> list[tuple]:
    """Frees that happen together (no allocation between them) in the order their tensors were made: a cache's
    release order (autocast's weight copies) follows object ids, which differ from run to run."""
    born: dict[int, int] = {}
    out: list[tuple] = []
    run: list[tuple] = []
    for ev in events:
        if ev[0]:
            out += sorted(run, key=lambda e: born.get(e[1], -1))
            run = []
            born[ev[1]] = len(born)
            out.append(ev)
        else:
            run.append(ev)
    return out + sorted(run, key=lambda e: born.get(e[1], -1))


def _fqn(tracked: str) -> str:
    """The module tracker's name ("LlamaForCausalLM.model.layers.0") -> the path within the model run."""
    return tracked.split(".", 1)[1] if "." in tracked else ""


def model_info(step) -> dict:
    """The copy's decoder-layer path, the units of layer READ_LAYER (peft tuner layers whole), the autocast copies
    the schedule makes itself (nn.Linear / Conv1D weights and biases, in the low dtype) and the loss's modules."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    model = step.model
    found = decoder_layers(model)
    if found is None or len(found[1]) <= READ_LAYER:
        raise LearnError(f"{type(model).__name__} has no list of decoder layers to learn from")
    layers_path, layers = found
    layer = layers[READ_LAYER]
    unshare_layer(list(layers), READ_LAYER)      # peft's cross-layer adapters: the read layer's own module objects
    modules = dict(layer.named_modules())
    units: set[str] = set()
    for pname, _p in layer.named_parameters():
        path = pname.rsplit(".", 1)[0] if "." in pname else ""
        parts = path.split(".") if path else []
        unit = next((".".join(parts[:n]) for n in range(1, len(parts) + 1)
                     if isinstance(modules.get(".".join(parts[:n])), BaseTunerLayer)), path)
        if unit:
            units.add(unit)
    low = 2 if step.autocast_dtype is not None else 0
    casts = {name: tuple(p.numel() * low for p in m.parameters(recurse=False))
             for name, m in modules.items() if type(m).__name__ in MATMUL_KINDS and low}
    lm = step.model.get_base_model() if hasattr(step.model, "get_base_model") else step.model
    lm_path = next((n for n, m in model.named_modules() if m is lm), "")
    parts = lm_path.split(".") if lm_path else []
    outer = tuple(".".join(parts[:n]) for n in range(len(parts) + 1))
    leaves = tuple(sorted(n for n, m in modules.items() if n and not any(True for _ in m.children())
                          and not any(True for _ in m.parameters()) and unit_of(n, tuple(units)) is None))
    model_type = lm.config.model_type

    def full(path: str) -> str:
        return ".".join(p for p in (lm_path, path) if p)
    spec = vision_spec(model_type)
    vision = {"module": full(vision_root(model_type)), "modules": tuple(map(full, vision_modules(model_type))),
              "blocks": full(spec.vision_blocks), "after_embedding": bool(spec.cross_attention_layers)} \
        if spec is not None else None
    return {"layers_path": layers_path, "units": tuple(sorted(units)), "casts": casts, "outer": outer,
            "leaves": leaves, "vision": vision, "layer": layer}


class ReadLayerDone(Exception):
    """Raised from the gradient hook on layer READ_LAYER's input: its backward is done, the rest is not read."""


def stop_after_read_layer(layer, ledger: Ledger, stop_at: list[int]):
    """Stop the backward once the gradient of layer READ_LAYER's input is made (its backward is complete): the earlier
    layers' backward, the embedding's gradients and the optimizer step are not read, so not run."""

    def pre_hook(_module, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        if isinstance(x, torch.Tensor) and x.requires_grad:
            def done(_grad):
                stop_at.append(len(ledger.events))
                raise ReadLayerDone
            x.register_hook(done)

    return layer.register_forward_pre_hook(pre_hook, with_kwargs=True)


