"""The ledger: every device allocation of the real step, as CUDA would see it.

An alloc event when an op first produces a storage (size rounded to 512 B like the caching allocator), a free event
when its last reference dies (a weakref callback on the storage), and FSDP2's storage resizes. Each event carries
its category (a component of the result), phase, module and stream. On fake tensors a FakeTensorMode subclass
reports every op; on real tensors (measure) a TorchDispatchMode does.

Host memory on the one fake device: a storage born inside `region(HOST)` (FSDP2's CPUOffloadPolicy: the sharded
parameters and gradients, llmem.runtime.distributed) is registered without a key, so it never reaches the device's
events, nor does any view of it. Its bytes are tallied apart (`host_now`, and `host_peaks` per phase: the job's
loading and saving phases count the host copies they make, llmem.runtime.host_copies).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from llmem.memory.allocator import kMinBlockSize as ROUND  # CUDA rounds every request to 512 bytes
from llmem.runtime.fake_sparse import COALESCE, SPARSE_MASK, fake_coalesce, fake_sparse_mask
from llmem.runtime.host_reads import answer_host_reads

PHASE_CODES = {"setup": 0, "forward": 1, "backward": 2, "optimizer_step": 3,
               "generation": 4, "scoring": 5,    # GRPO's phases before its forward (llmem.runtime.generation)
               "eval": 6,                        # the job's eval after the iterations (llmem.runtime.evaluation)
               "load": 7, "save": 8}             # the job's loading and saving (llmem.runtime.loading, saving)
STEP_FIRST_PHASES = ("forward", "generation")   # the phase an iteration starts with
# the phases in which the model runs
MODEL_PHASES = frozenset(PHASE_CODES[p] for p in ("forward", "backward", "generation", "scoring", "eval"))
PHASE_NAMES = {v: k for k, v in PHASE_CODES.items()}

_aten = torch.ops.aten

_MATMULS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
                      _aten.addbmm.default, _aten.mv.default, _aten.addmv.default, _aten.dot.default,
                      _aten._addmm_activation.default})


_TO_COPY = _aten._to_copy.default
_PIN_MEMORY = _aten._pin_memory.default
HOST = "host"      # the region category of host memory: no event (llmem.runtime.distributed's CPU offload)


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
        self.host_live: dict[int, int] = {}    # id(host storage) -> bytes (region HOST)
        self.host_now = 0
        self.host_peaks: dict[int, int] = {}   # phase code -> the host bytes live at their largest in it

    # -------------------------------------------------------------- categories and context
    def category_now(self) -> str:
        if self.regions:
            return self.regions[-1]
        if self.op_category is not None:
            return self.op_category
        ph = self.phase
        if ph in MODEL_PHASES:
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
            self.host_now -= self.host_live.pop(sid, 0)
            if key is not None:
                self._free(key)
        return callback

    def _host_alloc(self, sid: int, nbytes: int) -> None:
        """A host storage: tallied apart from the device's events (the phase's host peak)."""
        self.host_live[sid] = nbytes
        self.host_now += nbytes
        self.host_peaks[self.phase] = max(self.host_peaks.get(self.phase, 0), self.host_now)

    def on_host(self, t: torch.Tensor) -> bool:
        """Whether `t`'s storage was born on the host (region HOST)."""
        for local in local_tensors(t):
            try:
                return id(local.untyped_storage()) in self.host_live
            except (RuntimeError, NotImplementedError):
                return False
        return False

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
        on_host = (category or self.category_now()) == HOST
        key = self._alloc(n, category) if n > 0 and not on_host else None
        if on_host and n > 0:
            self._host_alloc(sid, n)
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
            for local in local_tensors(t):
                key = self.key_of(local)
                if key is not None:
                    self.cat[key] = category

    def before_op(self, func, args) -> str | None:
        """Op-level context. Returns the category the op's new storages get (or None)."""
        if not self.workspace_done and func in _MATMULS and self.phase > 0:
            self.workspace_done = True
            self._alloc(self.workspace_bytes, "cuda_workspaces")
        if func is _TO_COPY and self.phase in MODEL_PHASES and args:
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
            for local in local_tensors(t):
                self.track(local)
        live = sorted(self.live)
        order = {k: i for i, k in enumerate(live)}
        for t, cat in categories.items():
            for local in local_tensors(t) if isinstance(t, torch.Tensor) else ():
                key = self.key_of(local)
                if key is not None:
                    self.cat[key] = cat
        self.events = [(True, k, self.live[k], 0, -1, self.first_module.get(k, 0), 0)
                       for k in sorted(live, key=lambda k: (_CAT_ORDER.get(self.cat[k], 9), order[k]))]
        self.started = True


_CAT_ORDER = {"weights": 0, "communication_buffers": 1}


def local_tensors(t) -> Iterator[torch.Tensor]:
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        yield t._local_tensor
    elif isinstance(t, torch.Tensor):
        yield t


class TracingFakeMode(FakeTensorMode):
    """FakeTensorMode that reports every op and every new storage to the ledger, including the local ops that
    DTensor dispatch runs (they come through the fake mode as ops of their own).

    Only outermost ops count: when the fake mode has no meta kernel for an op it runs a Python decomposition inside
    itself (log_softmax -> amax, sub, exp, sum, log, ...), whose temporaries a fused CUDA kernel never allocates."""

    ledger: Ledger | None = None
    _depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PIN_MEMORY:
            # a fake tensor has no host memory to pin (FakeTensorMode has no kernel for it): the tensor as it is
            return args[0]
        if func is SPARSE_MASK:     # the fake kernel's result has no entries (llmem.runtime.fake_sparse)
            return fake_sparse_mask(self.__torch_dispatch__, types, *args)
        if func is COALESCE:        # ... and its coalesce none either
            return fake_coalesce(self.__torch_dispatch__, types, *args)
        led = self.ledger
        if led is None or self._depth:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            answer_host_reads(func, args, out)    # peft's module-dropout draws, VB-LoRA's inf check
            return out
        prev = led.op_category
        cat = led.before_op(func, args)
        self._depth = 1
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._depth = 0
        if out is not NotImplemented:
            answer_host_reads(func, args, out)
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


class StepRoles:
    """Phase markers from the step: relabel gradients and optimizer states, switch the logits region."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.step = None
        self.device_scalars = False

    def bind(self, step) -> None:
        self.step = step
        self.device_scalars = not step.setup.optimizer_spec.host_step_counters   # fused kernels keep them
        mt = self.ledger.mod_tracker
        # the lm_head, or a reward model's score head (--objective reward: a sequence-classification model)
        head = step.model.get_output_embeddings() or getattr(step.model, "score", None)
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
        if phase in STEP_FIRST_PHASES and it == 0 and not led.started:
            params = list(step.model.parameters())
            buffers = list(step.model.buffers())
            cats = {}
            led.start_step(params + buffers + [step.input_ids], cats)
            led.relabel(params + buffers, "weights")
            inputs = [v for v in step.extra_inputs.values() if isinstance(v, torch.Tensor)]  # a VLM's images
            led.relabel([step.input_ids, *inputs], "activations")
        if phase in STEP_FIRST_PHASES and it > 0:
            led.relabel(list(self._states()), "optimizer_states")
        if phase == "optimizer_step":
            led.relabel([p.grad for p in step.model.parameters()], "gradients")
            if led.mod_tracker is not None:     # the backward is over: the tracker's grad hooks let go
                led.mod_tracker.release_backward_hooks()
        led.skip_scalars = phase == "optimizer_step" and not self.device_scalars
        led.in_logits = phase == "backward"
        led.phase = PHASE_CODES[phase]
        led.iteration = it

    def finish(self) -> None:
        self.ledger.relabel(list(self._states()), "optimizer_states")


def _eager_mod_tracker():
    """torch's ModTracker, its module hooks left out of what dynamo traces: a compiled layer's own modules run inside
    its graph, tracked as the layer (llmem.runtime.compile).

    Its forward pre-hook hands a module's inputs to register_multi_grad_hook, whose "all" mode keeps the inputs'
    autograd nodes (torch/autograd/graph.py `grad_fns`) in the hook it sets on each input, which its node holds: a
    cycle through C++ that Python's collector cannot see, so every such node outlives the step, and with it the
    leaves its edges reach (an adapter's step with checkpointing: the embedding's output, made a leaf by
    enable_input_require_grads, and its .grad, one more kept each iteration, where the run without the tracker frees
    them with the graph). The pre-hook's handles are kept and removed once the backward is over
    (`release_backward_hooks`), which breaks the cycles. A module run under no_grad (TRL's reference and KL
    forwards) gets none: no backward runs through it, and the hook would keep its inputs (the embedding's output,
    a leaf that requires grad by enable_input_require_grads even under no_grad) until that release, where the run
    without the tracker frees them when the forward returns."""
    import torch.distributed._tools.mod_tracker as mod_tracker
    from torch.distributed._tools.mod_tracker import ModTracker

    class EagerModTracker(ModTracker):
        def __init__(self) -> None:
            super().__init__()
            self.backward_hooks: list = []      # the pre-hook's multi-grad hooks of this step

        def _fw_pre_hook(self, mod, input):
            if torch.compiler.is_compiling():
                return
            register = mod_tracker.register_multi_grad_hook

            def kept(tensors, fn, **kwargs):
                if not torch.is_grad_enabled():     # no graph through this module: no backward to track
                    return None
                handle = register(tensors, fn, **kwargs)
                self.backward_hooks.append(handle)
                return handle

            mod_tracker.register_multi_grad_hook = kept
            try:
                super()._fw_pre_hook(mod, input)
            finally:
                mod_tracker.register_multi_grad_hook = register

        def _fw_post_hook(self, mod, input, output):
            if not torch.compiler.is_compiling():
                super()._fw_post_hook(mod, input, output)

        def release_backward_hooks(self) -> None:
            for handle in self.backward_hooks:
                handle.remove()
            self.backward_hooks.clear()

    return EagerModTracker()


@contextlib.contextmanager
def tracking(ledger: Ledger, fake_mode: TracingFakeMode | None, real: bool) -> Iterator[StepRoles]:
    roles = StepRoles(ledger)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_fsdp_tracking(ledger))
        mt = stack.enter_context(_eager_mod_tracker())
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

