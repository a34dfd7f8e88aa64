"""Activations learned from the real code: the general path for set-ups without a hand recipe (a model family with
none written, a peft type without an exact model).

A copy of the model with LEARN_DEPTH decoder layers (its own config otherwise) runs one real training step on fake
tensors - the set-up's peft adapters, dtype regime, attention implementation, packing - through the trace's own
machinery (llmem.runtime.step's prepared_step, the ledger, the module tracker), at the batch x sequence POINTS.
Every allocation is read back with its module, phase and lifetime, and sorted by who releases it:

- decoder layer READ_LAYER (the last) keeps what is freed in its backward, and makes forward temporaries freed in its
  forward; what the layer before made and it releases (the residual stream) is its input, placed at its start;
- the head keeps what is freed in the final norm's and lm_head's backward (the loss itself is the schedule's);
- what the embedding side keeps until backward, less the first layer's inputs, is the embedding's (per sample) or
  shared (rotary cos/sin: no batch dimension).

The layer is cut into blocks at the first op of each module owning parameters (a peft tuner layer with its adapters
is one) and of each parameterless leaf module (an activation, a dropout), so the schedule gives each block its
parameters' autocast copies and gradients and its own backward transient; a temporary live across a cut is freed at
its block's end and made again at the next one's start. Each block's backward transient is the largest excess, over
its window of the backward, of what the real step holds (the layer's kept tensors still live, what backward made and
has not freed, the layer's gradients) over what the schedule holds there (the kept tensors of this and the earlier
blocks, the gradients of this and the later ones): with it the schedule's peak in that window is the real one.
Autocast's copies of nn.Linear weights are the schedule's (left out here); other weight-sized tensors (OFT's
rotations, a LayerNorm weight's fp32 copy) are learned as the layer's tensors.

Every size is fitted exactly (rational arithmetic) in 1, b, s, b*s, b*s^2 from the POINTS (batch >= 2), at which the
step must allocate alike, one for one (else the learning is refused with the reason). The result is cached per key
(llmem.memory.activations.learned) in memory and on disk.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import tempfile
import time
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from llmem.errors import LlmemError, first_line
from llmem.memory.activations.learned import (
    TERMS,
    LearnedActivations,
    LearnedBlock,
    as_floats,
    cached,
    learning_key,
    learning_need,
    remember,
)
from llmem.model.families import LAYERS_FIELDS, decoder_layers, family_of
from llmem.model.resolved import ResolvedSetup
from llmem.model.sharding import MATMUL_KINDS
from llmem.runtime.expert_parallel import learning_ep
from llmem.runtime.ledger import PHASE_CODES, Ledger, TracingFakeMode, tracking
from llmem.runtime.step import StepHooks, prepared_step

LEARN_DEPTH = 2          # decoder layers of the copy: layer 1 has a layer before it (its input) and the head after
READ_LAYER = 1
S0 = 64                  # tokens per sample at the first point (fake tensors: the cost does not depend on it)
# batch >= 2: at one sample some models take other paths (Mamba's mixer: a transpose that needs no copy)
POINTS = ((2, S0), (3, S0), (2, 2 * S0), (3, 2 * S0), (4, 3 * S0))
FORWARD, BACKWARD = PHASE_CODES["forward"], PHASE_CODES["backward"]
KEPT_CATEGORIES = ("activations", "logits_and_loss")


Exact = tuple[Fraction, ...]     # a size's coefficients in TERMS, exact while the layer is read


class LearnError(LlmemError):
    """The real code could not be run or read on the copy: the message says why."""


# ---------------------------------------------------------------------------------------------- entry point
def learned_activations(r: ResolvedSetup) -> LearnedActivations | None:
    """The learned activations of `r` when it needs them (learning_need), from the cache or learned now; None when it
    does not need them. LearnError when they cannot be learned."""
    need, why_not = learning_need(r)
    if not need:
        if why_not:
            raise LearnError(f"activations cannot be learned for this set-up: {why_not}")
        return None
    key = learning_key(r)
    hit = cached(key)
    if hit is not None:
        return hit
    learned = learn(r)
    remember(key, learned)
    return learned


def learn(r: ResolvedSetup, points: tuple[tuple[int, int], ...] = POINTS) -> LearnedActivations:
    """Run the copy at `points` and fit what its layers keep (not cached: learned_activations caches)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="llmem-learn-") as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(shallow_config(r.base.config, LEARN_DEPTH)))
        readings: list[Reading] = []
        for b, s in points:          # each point checked against the first as it comes: a refusal costs two runs
            with learning_ep(r.setup.ep, r.setup.ep_imbalance):   # --ep: the EP forward, all-to-alls emulated
                readings.append(run_point(learning_setup(r, str(path), b, s)))
            check_alike(readings, points)
    sizes = fit_sizes(readings, points)
    return read_layer(readings[0], sizes, points, time.perf_counter() - t0)


def shallow_config(config: dict, depth: int) -> dict:
    """The model's own config with `depth` decoder layers: the layer count of the text config (multimodal configs
    nest it) and the per-layer lists as long as it (attention kinds per layer) cut to `depth`."""
    out = copy.deepcopy(config)
    holder = out.get("text_config") if isinstance(out.get("text_config"), dict) else out
    name = next((n for n in LAYERS_FIELDS if isinstance(holder.get(n), int)), None)
    if name is None:
        raise LearnError("the model's config names no layer count (num_hidden_layers): no shallow copy to learn from")
    layers = holder[name]
    for k, v in list(holder.items()):
        if isinstance(v, list) and len(v) == layers and layers != depth:
            holder[k] = v[:depth]
    holder[name] = depth
    holder.update(family_of(str(holder.get("model_type", out.get("model_type")))).learn_copy)   # layer 1 a routed one
    return out


def learning_setup(r: ResolvedSetup, model_path: str, batch: int, seq: int):
    """The set-up the copy runs: the same adapters, precision and activation options on one GPU (the method's dtype
    regime kept: FSDP2's mixed precision computes in the low dtype, as pure low precision does), without the
    options the schedule lays out itself (checkpointing, offloading, the fused loss, the optimizer's placement)."""
    setup = r.setup
    precision = setup.precision
    adapter_dtype = setup.adapter_dtype
    if setup.mixed and not r.regime.autocast:        # FSDP2's MixedPrecisionPolicy: everything computes in low
        precision = setup.precision_spec.compute_dtype.replace("bfloat16", "bf16").replace("float16", "fp16")
        adapter_dtype = "base"
    return replace(setup, model=model_path, method="single", gpus=1, gpus_per_node=None, tp=None, batch_size=batch,
                   seq_len=seq, precision=precision, adapter_dtype=adapter_dtype, optimizer="adamw",
                   grad_ckpt=False, ckpt_every=1, offload_activations=False, fused_ce=False, offload_optimizer=False,
                   optimizer_in_backward=False, expandable_segments=False, ac_policy="full", ep=1,
                   ep_imbalance=1.0)


# ---------------------------------------------------------------------------------------------- one point
@dataclass
class Reading:
    """One point's step as the ledger saw it (iteration 0), and the copy's layer structure."""
    events: list[tuple[bool, int, int, int, str, str]]  # (is_alloc, key, bytes, phase, category, module path)
    layers_path: str                                     # e.g. "base_model.model.model.layers"
    units: tuple[str, ...]                               # parameter-owning modules of a layer, relative to it
    casts: dict[str, tuple[int, ...]]                    # nn.Linear module (relative) -> its autocast copies' bytes
    outer: tuple[str, ...]                               # the causal LM's path and its ancestors (loss ops)
    leaves: tuple[str, ...] = ()                         # parameterless leaf modules of a layer (activations)

    @property
    def cut_units(self) -> tuple[str, ...]:
        """Where the layer is cut into blocks: its parameter-owning modules and its parameterless leaves."""
        return self.units + self.leaves


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


class ModuleLedger(Ledger):
    """The trace's ledger, unrounded, with backward allocations given the module whose forward made the autograd node
    running (the module tracker's own backward names go stale: its post-backward hooks wait on positional inputs,
    and transformers calls attention and decoder layers with keyword arguments only)."""

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
        led = self.ledger
        if led.phase == FORWARD and led.mod_tracker is not None and torch.is_grad_enabled():
            parents = led.mod_tracker.parents
            name = max(parents, key=len) if len(parents) > 1 else "-"
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                node = t.grad_fn if isinstance(t, torch.Tensor) else None
                stack = [node]
                while stack:
                    n = stack.pop()
                    if n is None or NODE_TAG in n.metadata:
                        continue
                    n.metadata[NODE_TAG] = name
                    stack.extend(f for f, _ in n.next_functions)
        return out


def run_point(setup) -> Reading:
    """One training step of `setup` on fake tensors, its allocations recorded unrounded."""
    ledger = ModuleLedger(workspace_bytes=0, round_to=1)
    fake_mode = TracingFakeMode()
    roles: list = []
    info: dict = {}
    try:
        with contextlib.ExitStack() as outer:
            outer.enter_context(quiet_fake_tensor_log())

            def start_tracking() -> None:
                roles.append(outer.enter_context(tracking(ledger, fake_mode, real=False)))
                outer.enter_context(NodeModules(ledger))

            hooks = StepHooks(on_phase=lambda ph, it: roles[0].on_phase(ph, it), region=ledger.region)
            with prepared_step(setup, fake=True, fake_mode=fake_mode, hooks=hooks,
                               before_model=start_tracking) as step:
                roles[0].bind(step)
                info = model_info(step)
                stop_at: list[int] = []
                handle = stop_after_read_layer(info.pop("layer"), ledger, stop_at)
                try:
                    step.run(1)
                except ReadLayerDone:
                    pass
                handle.remove()
                if stop_at:        # the rest of the backward is not run (nor read: the graph is torn down)
                    del ledger.events[stop_at[0]:]
                # the gradients made so far, as the optimizer_step phase would label them (never reached)
                ledger.relabel([p.grad for p in step.model.parameters()], "gradients")
                ledger.enabled = False
                del step
    except LearnError:
        raise
    except LlmemError as exc:
        raise LearnError(f"the real step does not run on the copy: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - peft / transformers code on fake tensors: refused with the reason
        raise LearnError(f"the real step does not run on fake tensors ({type(exc).__name__}: "
                         f"{first_line(exc, 160)})") from None
    events = until_read_layer_done(without_loss(ledger, info["layers_path"], info["outer"]), info["layers_path"])
    return Reading(events, info["layers_path"], info["units"], info["casts"], info["outer"], info["leaves"])


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
                seen_layer = seen_layer or _layer_of(module, layers_path) is not None
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
        found = _layer_of(module, layers_path)
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
    modules = dict(layer.named_modules())
    others = {id(m) for i, other in enumerate(layers) if i != READ_LAYER for m in other.modules()}
    shared = sorted(n for n, m in modules.items() if id(m) in others)
    if shared:     # the module tracker names a shared module once: its ops could not be told apart by layer
        raise LearnError(f"decoder layers share modules ({shared[0]}: peft's cross-layer adapters): one layer's "
                         "allocations cannot be told apart from another's")
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
                          and not any(True for _ in m.parameters()) and _unit_of(n, tuple(units)) is None))
    return {"layers_path": layers_path, "units": tuple(sorted(units)), "casts": casts, "outer": outer,
            "leaves": leaves,
            "layer": layer}


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


# ---------------------------------------------------------------------------------------------- fitting
def _basis(b: int, s: int) -> tuple[int, ...]:
    return (1, b, s, b * s, b * s * s)


def _solve(rows: list[list[Fraction]], rhs: list[Fraction]) -> list[Fraction]:
    """Gauss-Jordan elimination in exact arithmetic."""
    n = len(rows)
    m = [row[:] + [v] for row, v in zip(rows, rhs, strict=True)]
    for c in range(n):
        pivot = next((r for r in range(c, n) if m[r][c] != 0), None)
        if pivot is None:
            raise LearnError("the learning points do not determine the size terms (a singular design)")
        m[c], m[pivot] = m[pivot], m[c]
        inv = 1 / m[c][c]
        m[c] = [v * inv for v in m[c]]
        for r in range(n):
            if r != c and m[r][c] != 0:
                f = m[r][c]
                m[r] = [a - f * bv for a, bv in zip(m[r], m[c], strict=True)]
    return [m[r][n] for r in range(n)]


def _signature(rd: Reading) -> list[tuple]:
    """The step's shape, sizes aside: each event's kind, phase, category and module, frees by their alloc's rank."""
    rank: dict[int, int] = {}
    out = []
    for a, key, _size, phase, cat, module in rd.events:
        if a:
            rank[key] = len(rank)
            out.append((True, phase, cat, module))
        else:
            out.append((False, phase, rank.get(key, -1)))
    return out


def check_alike(readings: list[Reading], points) -> None:
    """The points must run the same allocations in the same order (sizes aside); else LearnError says where."""
    first = _signature(readings[0])
    for rd, (b, s) in zip(readings[1:], points[1:len(readings)], strict=True):
        sig = _signature(rd)
        if sig != first:
            at = next((i for i, (x, y) in enumerate(zip(first, sig, strict=False)) if x != y), min(len(first),
                                                                                                   len(sig)))
            raise LearnError(f"the step allocates differently at batch {b} x {s} tokens than at {points[0][0]} x "
                             f"{points[0][1]} (event {at} of {len(first)}): its sizes are not polynomials in "
                             f"{', '.join(TERMS)}")


def fit_sizes(readings: list[Reading], points) -> dict[int, Exact]:
    """Each allocation's bytes (by its rank among the allocations) as a polynomial in TERMS, fitted exactly through
    the points. The points must run the same allocations in the same order."""
    check_alike(readings, points)
    rows = [[Fraction(v) for v in _basis(b, s)] for b, s in points]
    per_point = [[size for a, _k, size, *_ in rd.events if a] for rd in readings]
    # one elimination for every allocation: invert the design once (columns of the identity)
    n = len(rows)
    inverse_cols = [_solve(rows, [Fraction(int(i == j)) for i in range(n)]) for j in range(n)]
    out: dict[int, Exact] = {}
    for rank, values in enumerate(zip(*per_point, strict=True)):
        if len(set(values)) == 1:
            out[rank] = (Fraction(values[0]),) + (Fraction(0),) * (n - 1)
            continue
        coeffs = [sum(inverse_cols[j][i] * values[j] for j in range(n)) for i in range(n)]
        out[rank] = tuple(coeffs)
    return out


def _add(p: Exact, q: Exact, sign: int = 1) -> Exact:
    return tuple(a + sign * b for a, b in zip(p, q, strict=True))


ZERO: Exact = (Fraction(0),) * len(TERMS)


def _sum(polys) -> Exact:
    total = ZERO
    for p in polys:
        total = _add(total, p)
    return total


def _dominated(p: Exact, q: Exact) -> bool:
    """p <= q at every b, s >= 1 (every coefficient of q - p non-negative)."""
    return all(b >= a for a, b in zip(p, q, strict=True))


def _prune(candidates: list[Exact]) -> tuple[Exact, ...]:
    kept: list[Exact] = []
    for c in sorted(set(candidates), key=lambda p: tuple(-x for x in reversed(p))):
        if not any(_dominated(c, k) for k in kept):
            kept = [k for k in kept if not _dominated(k, c)] + [c]
    return tuple(kept)


# ---------------------------------------------------------------------------------------------- reading the layer
@dataclass
class _Tensor:
    rank: int
    size: Exact
    cat: str
    module: str                       # path within the model run
    at: int                           # event index of its allocation
    phase: int
    region: tuple
    freed_at: int | None = None       # event index of its free (iteration 0's forward and backward)
    freed_phase: int | None = None
    freed_region: tuple | None = None


def _layer_of(module: str, layers_path: str) -> tuple[int, str] | None:
    """(layer index, path within the layer) of a module path inside a decoder layer, else None."""
    prefix = layers_path + "."
    if not module.startswith(prefix):
        return None
    head, _, rest = module[len(prefix):].partition(".")
    return (int(head), rest) if head.isdigit() else None


def _unit_of(rel: str, units: tuple[str, ...]) -> str | None:
    best = None
    for u in units:
        if (rel == u or rel.startswith(u + ".")) and (best is None or len(u) > len(best)):
            best = u
    return best


def read_layer(rd: Reading, sizes: dict[int, Exact], points, seconds: float) -> LearnedActivations:
    """The learned layer, head, embedding and shared tensors from one point's events and the fitted sizes."""
    tensors, order = _lifetimes(rd, sizes)
    layer = ("layer", READ_LAYER)
    before = ("layer", READ_LAYER - 1)

    def relevant(t: _Tensor) -> bool:
        if t.cat in KEPT_CATEGORIES:
            return True
        return t.cat == "gathered_weights" and not _schedule_cast(t, rd)

    # the layer's own: freed in its forward (temporaries) or backward (kept), made by it or the layer before
    owned = [t for t in order if t.phase == FORWARD and relevant(t) and t.region in (layer, before)
             and (t.freed_region == layer or (t.freed_at is None and t.region == layer))]
    owned_ranks = {t.rank for t in owned}
    inputs = [t for t in owned if t.region == before]
    # the layer's forward in order: its inputs first, then its own events
    seq: list[tuple[bool, _Tensor]] = [(True, t) for t in inputs]
    for i, (a, key, _size, phase, _cat, _module) in enumerate(rd.events):
        if phase != FORWARD:
            continue
        t = tensors.get(key) if a else None
        if a and t is not None and t.rank in owned_ranks and t.region == layer and t.at == i:
            seq.append((True, t))
        elif not a:
            t = _freed_here(tensors, key, i)
            if t is not None and t.rank in owned_ranks and t.freed_phase == FORWARD:
                seq.append((False, t))
    blocks_seq, block_units = _cut(seq, rd)
    blocks, kept_by_block = _blocks(blocks_seq, block_units, set(rd.units))
    transients = _transients(rd, tensors, owned, kept_by_block, block_units)
    learned_blocks = tuple(LearnedBlock(b.name, b.params, tuple(map(as_floats, b.tensors)),
                                        tuple((as_floats(p), a, f) for p, a, f in b.temps),
                                        tuple(map(as_floats, transients[j])))
                           for j, b in enumerate(blocks))
    head = [t.size for t in order if t.phase == FORWARD and relevant(t) and t.cat != "gathered_weights"
            and t.region in (layer, ("post",)) and t.freed_region == ("head",) and t.module not in rd.outer]
    outside = [t for t in order if t.phase == FORWARD and t.region == ("pre",) and relevant(t)
               and t.cat != "gathered_weights" and t.freed_phase != FORWARD]
    # the first layer's inputs are made by its recipe (as READ_LAYER's are): left out here
    pending = [t.size for t in inputs if t.freed_phase != FORWARD]
    embed, shared = [], []
    for t in outside:
        if t.size in pending:
            pending.remove(t.size)
            continue
        batchless = all(c == 0 for c in (t.size[1], t.size[3], t.size[4]))
        (shared if batchless or "rotary" in t.module else embed).append(t.size)
    return LearnedActivations(learned_blocks, tuple(map(as_floats, embed)), tuple(map(as_floats, head)),
                              tuple(map(as_floats, shared)), LEARN_DEPTH,
                              tuple(points), round(seconds, 2), READ_LAYER)


def _schedule_cast(t: _Tensor, rd: Reading) -> bool:
    """An autocast copy of an nn.Linear's weight or bias: the schedule makes those itself."""
    found = _layer_of(t.module, rd.layers_path)
    rel = found[1] if found is not None else None
    return rel is not None and t.size[0] in rd.casts.get(rel, ()) and all(c == 0 for c in t.size[1:])


def _freed_here(tensors: dict[int, _Tensor], key: int, i: int) -> _Tensor | None:
    t = tensors.get(key)
    return t if t is not None and t.freed_at == i else None


def _lifetimes(rd: Reading, sizes: dict[int, Exact]) -> tuple[dict[int, _Tensor], list[_Tensor]]:
    """Every tensor made in forward or backward with its region (pre, layer k, post in forward; head, layer k,
    embed in backward) at birth and at death. A free belongs to the region of the allocation before it."""
    tensors: dict[int, _Tensor] = {}
    order: list[_Tensor] = []
    rank = -1
    region: tuple = ("pre",)
    phase_seen = None
    seen_layer = False
    for i, (a, key, _size, phase, cat, module) in enumerate(rd.events):
        if a:
            rank += 1
        if phase not in (FORWARD, BACKWARD):
            continue
        if phase != phase_seen:
            phase_seen, seen_layer = phase, False
            region = ("pre",) if phase == FORWARD else ("head",)
        if a:
            found = _layer_of(module, rd.layers_path)
            if found is not None:
                region, seen_layer = ("layer", found[0]), True
            elif module:       # the root's own ops keep the region they are in (a loss op, a mask)
                if phase == FORWARD:
                    region = ("post",) if seen_layer else ("pre",)
                else:
                    region = ("embed",) if seen_layer else ("head",)
            t = _Tensor(rank, sizes[rank], cat, module, i, phase, region)
            tensors[key] = t
            order.append(t)
        else:
            t = tensors.get(key)
            if t is not None and t.freed_at is None:
                t.freed_at, t.freed_phase, t.freed_region = i, phase, region
    return tensors, order


def _cut(seq: list[tuple[bool, _Tensor]], rd: Reading
         ) -> tuple[list[list[tuple[bool, _Tensor]]], list[tuple[str, ...]]]:
    """The layer's forward cut at the first op of each unit (the first stretch takes the first unit it meets)."""
    blocks: list[list[tuple[bool, _Tensor]]] = [[]]
    units: list[tuple[str, ...]] = [()]
    seen: set[str] = set()
    for alloc, t in seq:
        if alloc and t.region == ("layer", READ_LAYER):
            rel = _layer_of(t.module, rd.layers_path)[1]
            unit = _unit_of(rel, rd.cut_units)
            if unit is not None and unit not in seen:
                seen.add(unit)
                if units[-1]:
                    blocks.append([])
                    units.append((unit,))
                else:
                    units[-1] = (unit,)
        blocks[-1].append((alloc, t))
    return blocks, units


@dataclass
class _Block:
    name: str
    params: tuple[str, ...]
    tensors: tuple[Exact, ...]
    temps: tuple[tuple[Exact, float, float], ...]


def _blocks(blocks_seq, units, param_units: set[str]) -> tuple[list[_Block], list[Exact]]:
    """Blocks from the cut sequence: kept tensors at integer positions, temporaries between them; one live across
    a cut is freed at its block's end and made again at the start of the next."""
    out: list[_Block] = []
    kept_sums: list[Exact] = []
    live: list[_Tensor] = []                  # temporaries carried into the next block, in allocation order
    for j, (items, unit) in enumerate(zip(blocks_seq, units, strict=True)):
        events: list[tuple[str, _Tensor]] = [("carry", t) for t in live]
        for alloc, t in items:
            kept = t.freed_phase != FORWARD
            events.append(("kept" if alloc and kept else "alloc" if alloc else "free", t))
        kept_list = [t for kind, t in events if kind == "kept"]
        n = len(kept_list)
        positions = _positions([kind == "kept" for kind, _t in events])
        temps: list[tuple[Exact, float, float]] = []
        opened: dict[int, float] = {}
        for idx, (kind, t) in enumerate(events):
            if kind in ("carry", "alloc"):
                opened[t.rank] = positions[idx]
            elif kind == "free" and t.rank in opened:
                temps.append((t.size, opened.pop(t.rank), positions[idx]))
        end = n + 1.5
        live = [t for kind, t in events if kind in ("carry", "alloc") and t.rank in opened]
        temps += [(t.size, opened[t.rank], end) for t in live]
        name = "+".join(unit) or f"block{j}"
        params = tuple(f".{u}." for u in unit if u in param_units)
        out.append(_Block(name, params, tuple(t.size for t in kept_list), tuple(temps)))
        kept_sums.append(_sum(t.size for t in kept_list))
    return out, kept_sums


def _positions(is_kept: list[bool]) -> list[float]:
    """Block positions of a block's events in order: kept tensors at 0, 1, ...; the other events spread evenly in
    the gap before the next kept tensor (before the first: in (-1, 0); after the last: in (n, n + 1))."""
    out = [0.0] * len(is_kept)
    gap: list[int] = []
    k = 0
    for idx, kept in enumerate(is_kept + [True]):
        if kept:
            at = k if idx < len(is_kept) else k + 1
            for r, g in enumerate(gap):
                out[g] = at - 1 + (r + 1) / (len(gap) + 1)
            gap = []
            if idx < len(is_kept):
                out[idx] = float(k)
                k += 1
        else:
            gap.append(idx)
    return out


def _transients(rd: Reading, tensors: dict[int, _Tensor], owned: list[_Tensor], kept_by_block: list[Exact],
                units: list[tuple[str, ...]]) -> list[tuple[Exact, ...]]:
    """Each block's backward transient candidates: over its window of layer READ_LAYER's backward, what the real
    step holds (the layer's kept tensors still live, backward's own tensors not yet freed, the layer's gradients)
    less what the schedule holds at the block's transient (kept tensors of this block and the earlier ones,
    gradients of this block and the later ones)."""
    layer = ("layer", READ_LAYER)
    block_of_unit = {u: j for j, us in enumerate(units) for u in us}
    nblocks = len(units)

    def block_of(t: _Tensor) -> int | None:
        found = _layer_of(t.module, rd.layers_path)
        if found is None or found[0] != READ_LAYER:
            return None
        unit = _unit_of(found[1], rd.cut_units)
        return block_of_unit.get(unit) if unit is not None else None

    kept_live = {t.rank for t in owned if t.freed_phase != FORWARD}
    sizes = {t.rank: t.size for t in owned}
    grads = [t for t in tensors.values() if t.phase == BACKWARD and t.cat == "gradients" and t.region == layer]
    grad_from = [ZERO] * (nblocks + 1)         # gradients of blocks >= j
    for t in grads:
        j = block_of(t)
        j = nblocks - 1 if j is None else j
        for k in range(j + 1):
            grad_from[k] = _add(grad_from[k], t.size)
    kept_upto = []
    total = ZERO
    for p in kept_by_block:
        total = _add(total, p)
        kept_upto.append(total)
    # the backward's events in layer READ_LAYER, each with its block: a unit's op its own, another op the next
    # unit's (a parameterless op runs before, in backward, the module it followed in forward), a free the previous
    # event's
    bw: list[tuple[int, bool, _Tensor]] = []
    for i, (a, key, *_rest) in enumerate(rd.events):
        t = tensors.get(key)
        if rd.events[i][3] == BACKWARD and t is not None and (a and t.at == i or not a and t.freed_at == i):
            bw.append((i, a, t))
    in_layer = [(i, a, t) for i, a, t in bw if (t.region if a else t.freed_region) == layer]
    assign: dict[int, int] = {}
    nxt = 0
    for i, a, t in reversed(in_layer):
        if a:
            j = block_of(t)
            nxt = nxt if j is None else j
            assign[i] = nxt
    last = 0
    for i, a, _t in in_layer:
        if a:
            last = assign[i]
        else:
            assign[i] = last

    def counts(t: _Tensor) -> bool:
        """Held by the real step and not by the schedule's view at the block (what the transient stands for): the
        layer's kept tensors, what its backward makes (gradients included), and what the head's backward hands on
        (the gradient flowing in). A weight-sized tensor from the head's backward is a tied weight's gradient
        waiting in its AccumulateGrad for the embedding's: the schedule holds it as that gradient already."""
        if t.rank in kept_live:
            return True
        if t.phase != BACKWARD:
            return False
        if t.region == layer:
            return t.cat in KEPT_CATEGORIES or t.cat == "gradients"
        return t.cat in KEPT_CATEGORIES and any(c != 0 for c in t.size[1:])

    held = _sum(sizes[r] for r in kept_live)
    candidates: list[list[Exact]] = [[] for _ in range(nblocks)]
    for i, a, t in bw:
        if counts(t):
            held = _add(held, t.size, 1 if a else -1)
        j = assign.get(i)
        if j is not None:
            candidates[j].append(_add(held, _add(kept_upto[j], grad_from[j]), -1))
    return [_prune(c) for c in candidates]
