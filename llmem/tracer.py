"""trace: run the real training step on fake tensors and record every allocation and free, as CUDA would see them.

The step (llmem.step) runs on fake cpu tensors with CUDA's behaviour emulated where it changes memory (autocast op
policy, fused dropout's bool mask, the fused SDPA kernels, AdamW's foreach default). A ledger follows every tensor
storage: an alloc event when an op first produces it (size rounded to 512 B like the caching allocator), a free event
when its last reference dies (a weakref callback on the storage), and FSDP2's storage resizes. Each event carries its
category, phase and module. The event stream is then replayed through llmem.allocator's model of the CUDA caching
allocator for the reserved memory; the cuBLAS workspace (one block from the allocator at the first matmul) and the
CUDA context (outside the allocator) complete the picture: device_used = peak_reserved + context.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from llmem.allocator import kMinBlockSize as ROUND  # CUDA rounds every request to 512 bytes
from llmem.result import ALLOCATED_COMPONENTS, MemoryResult

MAX_TIMELINE_POINTS = 2000
_PHASE_CODES = {"setup": 0, "forward": 1, "backward": 2, "optimizer_step": 3}
_PHASE_NAMES = {v: k for k, v in _PHASE_CODES.items()}

_aten = torch.ops.aten
_MATMULS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
                      _aten.addbmm.default, _aten.mv.default, _aten.addmv.default, _aten.dot.default,
                      _aten._addmm_activation.default})
_TO_COPY = _aten._to_copy.default


class Ledger:
    """Every device allocation of the step: storages born, resized and freed, with what they are."""

    def __init__(self, workspace_bytes: int = 0, round_to: int = ROUND) -> None:
        self.round_to = round_to
        self.events: list[tuple] = []          # (is_alloc, key, size, phase, iteration, module, stream)
        self.sid_key: dict[int, int | None] = {}   # id(storage object) -> live key (None while 0 bytes)
        self.refs: dict[int, weakref.ref] = {}
        self.live: dict[int, int] = {}         # key -> rounded size
        self.cat: dict[int, str] = {}          # key -> category (final: relabelled when roles are discovered)
        self.first_module: dict[int, int] = {}
        self.next_key = 0
        self.phase = 0
        self.iteration = -1
        self.regions: list[str] = []
        self.op_category: str | None = None
        self.in_logits = False
        self.skip_scalars = False
        self.workspace_bytes = workspace_bytes
        self.workspace_done = workspace_bytes <= 0
        self.module_names: list[str] = ["-"]
        self.module_index: dict[str, int] = {"-": 0}
        self.mod_tracker = None
        self.streams: dict[int, int] = {}
        self.started = False
        self.enabled = True

    # -------------------------------------------------------------- categories and context
    def category_now(self) -> str:
        if self.regions:
            return self.regions[-1]
        if self.op_category is not None:
            return self.op_category
        ph = self.phase
        if ph == 1 or ph == 2:
            return "logits_and_loss" if self.in_logits else "activations"
        if ph == 3:
            return "optimizer_temporaries"
        return "weights"

    def module_now(self) -> int:
        mt = self.mod_tracker
        if mt is None:
            return 0
        parents = mt.parents
        if len(parents) <= 1:
            return 0
        name = max(parents, key=len)
        idx = self.module_index.get(name)
        if idx is None:
            idx = self.module_index[name] = len(self.module_names)
            self.module_names.append(name)
        return idx

    def stream_now(self) -> int:
        s = torch.cpu.current_stream()
        sid = self.streams.get(id(s))
        if sid is None:
            sid = self.streams[id(s)] = 0 if s is torch.cpu._default_cpu_stream else len(self.streams) + 1
        return sid

    @contextlib.contextmanager
    def region(self, category: str | None) -> Iterator[None]:
        if category is None:
            yield
            return
        self.regions.append(category)
        try:
            yield
        finally:
            self.regions.pop()

    # -------------------------------------------------------------- events
    def _alloc(self, nbytes: int, category: str | None = None) -> int:
        key = self.next_key
        self.next_key = key + 1
        r = self.round_to
        size = -(-nbytes // r) * r
        self.live[key] = size
        self.cat[key] = category or self.category_now()
        mod = self.module_now()
        self.first_module[key] = mod
        self.events.append((True, key, size, self.phase, self.iteration, mod, self.stream_now()))
        return key

    def _free(self, key: int) -> None:
        if not self.enabled:
            return      # teardown after the step: the stream ends with the step
        size = self.live.pop(key, None)
        if size is not None:
            self.events.append((False, key, size, self.phase, self.iteration, 0, 0))

    def _finalizer(self, sid: int):
        def callback(_ref, self=self, sid=sid):
            key = self.sid_key.pop(sid, None)
            self.refs.pop(sid, None)
            if key is not None:
                self._free(key)
        return callback

    def track_storage(self, st, dim0: bool = False, category: str | None = None) -> int | None:
        """Register a storage the first time it is seen. Returns its live key (None if 0 bytes or skipped)."""
        sid = id(st)
        if sid in self.sid_key:
            return self.sid_key[sid]
        if not self.enabled:
            return None
        if dim0 and self.skip_scalars:
            return None   # a host-side scalar in the real run (optimizer step counters)
        n = st.nbytes()
        self.refs[sid] = weakref.ref(st, self._finalizer(sid))
        key = self._alloc(n, category) if n > 0 else None
        self.sid_key[sid] = key
        return key

    def track(self, t: torch.Tensor) -> None:
        cls = type(t)
        if cls is not FakeTensor and cls is not torch.Tensor and is_traceable_wrapper_subclass(t):
            # DTensor and other wrappers: their own storage is a placeholder, the memory is in the inner tensors
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self.track(inner)
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if id(st) not in self.sid_key:
            self.track_storage(st, t.dim() == 0)

    def track_outputs(self, out) -> None:
        if isinstance(out, torch.Tensor):
            self.track(out)
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self.track(o)
                elif isinstance(o, (tuple, list)):
                    self.track_outputs(o)

    def resized(self, t: torch.Tensor, category: str | None = None) -> None:
        """A storage changed size in place (FSDP2's alloc_storage / free_storage)."""
        st = t.untyped_storage()
        sid = id(st)
        if sid not in self.sid_key:
            self.track_storage(st, category=category)
            return
        old = self.sid_key[sid]
        n = st.nbytes()
        if old is not None:
            if self.live.get(old) == -(-n // self.round_to) * self.round_to:
                return
            self._free(old)
        self.sid_key[sid] = self._alloc(n, category) if n > 0 else None

    def key_of(self, t: torch.Tensor) -> int | None:
        if type(t) is not FakeTensor and is_traceable_wrapper_subclass(t):
            return None
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        return self.sid_key.get(id(st))

    def relabel(self, tensors, category: str) -> None:
        for t in tensors:
            if t is None:
                continue
            for local in _local_tensors(t):
                key = self.key_of(local)
                if key is not None:
                    self.cat[key] = category

    def before_op(self, func, args) -> str | None:
        """Op-level context. Returns the category the op's new storages get (or None)."""
        if not self.workspace_done and func in _MATMULS and self.phase > 0:
            self.workspace_done = True
            self._alloc(self.workspace_bytes, "cuda_workspaces")
        if func is _TO_COPY and (self.phase == 1 or self.phase == 2) and args:
            a = args[0]
            if isinstance(a, torch.Tensor):
                key = self.key_of(a)
                if key is not None and self.cat.get(key) == "weights":
                    return "gathered_weights"   # autocast's low-precision copy of a weight (also when recomputed)
        return None

    # -------------------------------------------------------------- phases
    def start_step(self, initial: list[torch.Tensor], categories: dict[int, str]) -> None:
        """Forget the setup history: the step starts with what is live now (params first), as allocations."""
        for t in initial:
            for local in _local_tensors(t):
                self.track(local)
        live = sorted(self.live)
        order = {k: i for i, k in enumerate(live)}
        for t, cat in categories.items():
            for local in _local_tensors(t) if isinstance(t, torch.Tensor) else ():
                key = self.key_of(local)
                if key is not None:
                    self.cat[key] = cat
        self.events = [(True, k, self.live[k], 0, -1, self.first_module.get(k, 0), 0)
                       for k in sorted(live, key=lambda k: (_CAT_ORDER.get(self.cat[k], 9), order[k]))]
        self.started = True


_CAT_ORDER = {"weights": 0, "communication_buffers": 1}


def _local_tensors(t) -> Iterator[torch.Tensor]:
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        yield t._local_tensor
    elif isinstance(t, torch.Tensor):
        yield t


class _TracingFakeMode(FakeTensorMode):
    """FakeTensorMode that reports every op and every new storage to the ledger, including the local ops that
    DTensor dispatch runs (they come through the fake mode as ops of their own).

    Only outermost ops count: when the fake mode has no meta kernel for an op it runs a Python decomposition inside
    itself (log_softmax -> amax, sub, exp, sum, log, ...), whose temporaries a fused CUDA kernel never allocates."""

    ledger: Ledger | None = None
    _depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        led = self.ledger
        if led is None or self._depth:
            return super().__torch_dispatch__(func, types, args, kwargs)
        prev = led.op_category
        cat = led.before_op(func, args)
        self._depth = 1
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._depth = 0
        if out is not NotImplemented:
            if cat is not None:
                led.op_category = cat
                try:
                    led.track_outputs(out)
                finally:
                    led.op_category = prev
            else:
                led.track_outputs(out)
        return out


class RealTracker(TorchDispatchMode):
    """The same ledger on real tensors (measure on cpu): every op's new output storages."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        led = self.ledger
        prev = led.op_category
        cat = led.before_op(func, args)
        if cat is not None:
            led.op_category = cat
        try:
            out = func(*args, **(kwargs or {}))
            led.track_outputs(out)
        finally:
            led.op_category = prev
        return out


# ------------------------------------------------------------------------------------------------------------------
# FSDP2 and the step's roles
# ------------------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _fsdp_tracking(ledger: Ledger) -> Iterator[None]:
    """FSDP2 allocates unsharded parameters by resizing storages in place, which no dispatch mode sees; its
    all-gather and reduce-scatter buffers are labelled communication buffers, and the unsharded gradients it
    reduces are gradients."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param, _fsdp_param_group

    orig_alloc, orig_free = _fsdp_param.alloc_storage, _fsdp_param.free_storage
    orig_ag, orig_reduce = _fsdp_param_group.foreach_all_gather, _fsdp_param_group.foreach_reduce

    def alloc_storage(tensor):
        orig_alloc(tensor)
        ledger.resized(tensor, "gathered_weights")

    def free_storage(tensor):
        orig_free(tensor)
        ledger.resized(tensor)

    def foreach_all_gather(*args, **kwargs):
        with ledger.region("communication_buffers"):
            return orig_ag(*args, **kwargs)

    def foreach_reduce(fsdp_params, unsharded_grads, *args, **kwargs):
        ledger.relabel(list(unsharded_grads), "gradients")
        with ledger.region("communication_buffers"):
            return orig_reduce(fsdp_params, unsharded_grads, *args, **kwargs)

    patches = [(_fsdp_param, "alloc_storage", alloc_storage), (_fsdp_param, "free_storage", free_storage),
               (_fsdp_param_group, "alloc_storage", alloc_storage),
               (_fsdp_param_group, "foreach_all_gather", foreach_all_gather),
               (_fsdp_param_group, "foreach_reduce", foreach_reduce)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    _ = _fsdp_collectives
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


class _StepRoles:
    """Phase markers from the step: relabel gradients and optimizer states, switch the logits region."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.step = None
        self.fused = False

    def bind(self, step) -> None:
        self.step = step
        self.fused = step.setup.optimizer == "adamw-fused"
        mt = self.ledger.mod_tracker
        head = step.model.get_output_embeddings()
        root = step.model
        led = self.ledger

        def pre_fw(mod, _inputs):
            if mod is head:
                led.in_logits = True

        def post_fw(mod, _inputs, _out):
            if mod is root:
                led.in_logits = False

        def pre_bw(mod, _grads):
            if mod is head:
                led.in_logits = False

        if mt is not None:
            mt.register_user_hooks(pre_fw_hook=pre_fw, post_fw_hook=post_fw, pre_bw_hook=pre_bw)

    def _states(self):
        for state in self.step.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    def on_phase(self, phase: str, it: int) -> None:
        led = self.ledger
        step = self.step
        if phase == "forward" and it == 0 and not led.started:
            params = list(step.model.parameters())
            buffers = list(step.model.buffers())
            cats = {}
            led.start_step(params + buffers + [step.input_ids], cats)
            led.relabel(params + buffers, "weights")
            led.relabel([step.input_ids], "activations")
        if phase == "forward" and it > 0:
            led.relabel(list(self._states()), "optimizer_states")
        if phase == "optimizer_step":
            led.relabel([p.grad for p in step.model.parameters()], "gradients")
        led.skip_scalars = phase == "optimizer_step" and not self.fused
        led.in_logits = phase == "backward"
        led.phase = _PHASE_CODES[phase]
        led.iteration = it

    def finish(self) -> None:
        self.ledger.relabel(list(self._states()), "optimizer_states")


# ------------------------------------------------------------------------------------------------------------------
# Replay through the caching-allocator model and build the result
# ------------------------------------------------------------------------------------------------------------------

def replay_ledger(ledger: Ledger, *, expandable_segments: bool = False) -> dict:
    """Run the events through the CachingAllocator model.

    Returns the allocator's peaks (CUDA's max_memory_allocated / max_memory_reserved: whole blocks, so a large
    block that was not split counts in full), the tensor bytes per category at the moment of peak allocated, the
    same per phase (at each phase's own peak of tensor bytes), each category's own maximum, and the
    (allocated, reserved, phase) series."""
    from llmem.allocator import CachingAllocator

    alloc = CachingAllocator(expandable_segments=expandable_segments)
    malloc, free, stats = alloc.malloc, alloc.free, alloc.stats
    handles: dict[int, int] = {}
    cat_of = ledger.cat
    by_cat: dict[str, int] = dict.fromkeys(ALLOCATED_COMPONENTS, 0)
    cat_max: dict[str, int] = dict.fromkeys(ALLOCATED_COMPONENTS, 0)
    phase_peak: dict[int, tuple[int, dict]] = {}
    tensors = 0
    peak = -1
    peak_idx = 0
    peak_cats: dict[str, int] = {}
    series_alloc: list[int] = []
    series_res: list[int] = []
    series_phase: list[int] = []
    for i, (is_alloc, key, size, phase, _it, _mod, stream) in enumerate(ledger.events):
        cat = cat_of.get(key, "activations")
        if is_alloc:
            handles[key] = malloc(size, stream)
            by_cat[cat] += size
            tensors += size
            if by_cat[cat] > cat_max[cat]:
                cat_max[cat] = by_cat[cat]
            best = phase_peak.get(phase)
            if best is None or tensors > best[0]:
                phase_peak[phase] = (tensors, dict(by_cat))
        else:
            h = handles.pop(key, None)
            if h is None:
                continue
            free(h)
            by_cat[cat] -= size
            tensors -= size
        st = stats()
        allocated = st.allocated_bytes
        if allocated > peak:
            peak, peak_idx, peak_cats = allocated, i, dict(by_cat)
        series_alloc.append(allocated)
        series_res.append(st.reserved_bytes)
        series_phase.append(phase)
    final = stats()
    return {"peak_allocated": final.peak_allocated_bytes, "peak_reserved": final.peak_reserved_bytes,
            "peak_index": peak_idx, "components": peak_cats, "allocated": series_alloc, "reserved": series_res,
            "phase": series_phase, "num_segments": final.num_segments, "category_max": cat_max,
            "phase_peaks": {_PHASE_NAMES[p]: {"tensor_bytes": v[0], "components": v[1]}
                            for p, v in sorted(phase_peak.items())}}


@dataclass
class TraceDetails:
    """What the MemoryResult leaves out: tensor-level peaks per phase, each category's own maximum, the biggest
    allocations live at the peak (with their module), and the raw ledger."""
    phase_peaks: dict[str, dict]          # phase -> {"tensor_bytes", "components"} at that phase's peak
    category_max: dict[str, int]
    top_at_peak: list[dict]
    ledger: Ledger
    wall_seconds: float = 0.0


def top_allocations_at(ledger: Ledger, index: int, n: int = 15) -> list[dict]:
    live: dict[int, tuple] = {}
    for is_alloc, key, size, phase, it, mod, _s in ledger.events[: index + 1]:
        if is_alloc:
            live[key] = (size, phase, it, mod)
        else:
            live.pop(key, None)
    groups: dict[tuple, list[int]] = {}
    for key, (size, _phase, _it, mod) in live.items():
        g = groups.setdefault((ledger.cat.get(key, "activations"), ledger.module_names[mod]), [0, 0])
        g[0] += size
        g[1] += 1
    rows = [{"category": c, "module": m, "bytes": b, "count": k} for (c, m), (b, k) in groups.items()]
    rows.sort(key=lambda r: -r["bytes"])
    return rows[:n]


def downsample(series: dict, max_points: int = MAX_TIMELINE_POINTS) -> list[dict]:
    alloc, res, phase = series["allocated"], series["reserved"], series["phase"]
    n = len(alloc)
    if n == 0:
        return []
    if n <= max_points:
        picks = range(n)
    else:
        per = -(-n // (max_points - 1))
        picks = []
        for start in range(0, n, per):
            stop = min(n, start + per)
            best = max(range(start, stop), key=alloc.__getitem__)
            picks.append(best)
        if series["peak_index"] not in picks:
            picks.append(series["peak_index"])
            picks.sort()
        picks = picks[:max_points]
    return [{"t": i, "allocated": alloc[i], "reserved": res[i], "phase": _PHASE_NAMES[phase[i]]} for i in picks]


def build_result(engine: str, ledger: Ledger, setup, gpu, total_params: int, notes: list[str],
                 series: dict | None = None, managed_bytes: int = 0) -> MemoryResult:
    series = series or replay_ledger(ledger, expandable_segments=setup.expandable_segments)
    peak_alloc = series["peak_allocated"]
    peak_res = series["peak_reserved"]
    comps = {name: int(series["components"].get(name, 0)) for name in ALLOCATED_COMPONENTS}
    # The categories hold tensor bytes (512-B rounded). CUDA's memory_allocated also counts the unsplit tail of a
    # large block (a 21.5 MiB tensor cut from a 22 MiB segment holds all 22 MiB): that is block_rounding.
    comps["block_rounding"] = peak_alloc - sum(comps.values())
    comps["allocator_overhead"] = peak_res - peak_alloc
    comps["cuda_context"] = gpu.cuda_context_bytes
    comps["managed_memory"] = managed_bytes      # paged optimizer states: device memory outside the allocator
    phase = _PHASE_NAMES[series["phase"][series["peak_index"]]] if series["phase"] else ""
    setup_dict = setup.to_dict()
    setup_dict["total_params"] = total_params
    return MemoryResult(engine=engine, peak_allocated_bytes=peak_alloc, peak_reserved_bytes=peak_res,
                        device_used_bytes=peak_res + gpu.cuda_context_bytes + managed_bytes,
                        gpu_memory_bytes=gpu.memory_bytes,
                        components=comps, setup=setup_dict, peak_phase=phase, notes=notes,
                        timeline=downsample(series))


def method_notes(layout, setup) -> list[str]:
    notes = []
    if layout.world_size > 1:
        notes.append(f"rank 0 of {layout.world_size} emulated on a fake process group ({layout.label}); NCCL's "
                     "internal buffers are not included")
    if setup.precision == "fp16-mixed":
        notes.append("fp16-mixed: the GradScaler's state (a few scalars) is not included")
    if setup.quant_base != "none":
        notes.append(f"bitsandbytes {setup.quant_base} base: its CUDA kernels are emulated (storage tensors, "
                     "dequantisation / int8 buffers as bitsandbytes allocates them), not run")
    from llmem.activations import activation_notes

    return notes + activation_notes(setup)


# ------------------------------------------------------------------------------------------------------------------
# trace()
# ------------------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def tracking(ledger: Ledger, fake_mode: _TracingFakeMode | None, real: bool) -> Iterator[_StepRoles]:
    from torch.distributed._tools.mod_tracker import ModTracker

    roles = _StepRoles(ledger)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_fsdp_tracking(ledger))
        mt = stack.enter_context(ModTracker())
        ledger.mod_tracker = mt
        if fake_mode is not None:
            fake_mode.ledger = ledger
            stack.callback(setattr, fake_mode, "ledger", None)
        if real:
            stack.enter_context(RealTracker(ledger))
        try:
            yield roles
        finally:
            ledger.enabled = False
            ledger.mod_tracker = None


def trace(setup, *, iterations: int = 2, progress: Callable[[str], None] | None = None,
          cuda_kernels: bool = True) -> MemoryResult:
    """Trace `iterations` real training steps of `setup` on fake tensors (rank 0 of the layout) and return what a
    CUDA GPU would show: peak allocated / reserved, device used, and the breakdown at peak allocated.

    cuda_kernels=False keeps the CPU dispatcher's SDPA choice (for cross-checks against real CPU runs)."""
    return trace_with_details(setup, iterations=iterations, progress=progress, cuda_kernels=cuda_kernels)[0]


def trace_with_details(setup, *, iterations: int = 2, progress: Callable[[str], None] | None = None,
                       cuda_kernels: bool = True) -> tuple[MemoryResult, TraceDetails]:
    from llmem.hardware import resolve_gpu
    from llmem.step import StepHooks, prepared_step

    say = progress or (lambda msg: None)
    gpu = resolve_gpu(setup.gpu, setup.gpu_memory, setup.cuda_context)
    t0 = time.perf_counter()
    ledger = Ledger(workspace_bytes=gpu.cublas_workspace_bytes)
    fake_mode = _TracingFakeMode()
    roles_box: list[_StepRoles] = []

    with contextlib.ExitStack() as outer:
        def start_tracking() -> None:
            roles_box.append(outer.enter_context(tracking(ledger, fake_mode, real=False)))

        hooks = StepHooks(on_phase=lambda ph, it: roles_box[0].on_phase(ph, it), region=ledger.region)
        with prepared_step(setup, fake=True, fake_mode=fake_mode, hooks=hooks, cuda_kernels=cuda_kernels,
                           before_model=start_tracking, progress=say) as step:
            roles = roles_box[0]
            roles.bind(step)
            step.run(iterations, progress=say)
            roles.finish()
            ledger.enabled = False
            layout = step.layout
            total_params = step.total_params
            managed = getattr(step.optimizer, "outside_allocator_bytes", 0)
            del step
    say("replaying the allocator")
    series = replay_ledger(ledger, expandable_segments=setup.expandable_segments)
    wall = time.perf_counter() - t0
    notes = method_notes(layout, setup)
    from llmem.estimator import optimizer_notes

    notes += optimizer_notes(setup, "trace")
    notes.append(f"trace: {len(ledger.events)} allocator events, {wall:.1f} s")
    result = build_result("trace", ledger, setup, gpu, total_params, notes, series, managed)
    details = TraceDetails(series["phase_peaks"], series["category_max"],
                           top_allocations_at(ledger, series["peak_index"]), ledger, wall)
    return result, details


def plot_timeline(result: MemoryResult, path_png: str) -> str:
    """Allocated and reserved memory over the traced events, phases shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result.timeline or []
    fig, ax = plt.subplots(figsize=(10, 4.5))
    if tl:
        ts = [p["t"] for p in tl]
        gib = 1024 ** 3
        ax.plot(ts, [p["allocated"] / gib for p in tl], label="allocated", lw=1.2)
        ax.plot(ts, [p["reserved"] / gib for p in tl], label="reserved", lw=1.2)
        colors = {"setup": "#eeeeee", "forward": "#dbe9f6", "backward": "#fde2cf", "optimizer_step": "#dff2dc"}
        start = 0
        for i in range(1, len(tl) + 1):
            if i == len(tl) or tl[i]["phase"] != tl[start]["phase"]:
                end = ts[i] if i < len(tl) else ts[-1]
                ax.axvspan(ts[start], end, color=colors.get(tl[start]["phase"], "#ffffff"), lw=0)
                start = i
        ax.axhline(result.device_used_bytes / gib, color="k", ls=":", lw=0.8, label="device used (peak)")
    ax.set_xlabel("allocator event")
    ax.set_ylabel("GiB")
    s = result.setup
    ax.set_title(f"{s.get('model', '')} {s.get('method', '')} x{s.get('gpus', 1)} {s.get('precision', '')} "
                 f"b{s.get('batch_size', '')} s{s.get('seq_len', '')}: peak {result.peak_allocated_bytes / 1024**3:.2f}"
                 f" GiB allocated ({result.peak_phase})", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path_png, dpi=110)
    plt.close(fig)
    return path_png
