"""A deep model's whole step schedule made from a shallow one: its template decoder layer's events repeated.

Identical decoder layers make identical events: the same sizes, components and streams, each layer's tensors freed
where the layer before it freed its own. A schedule built with a few layers (`Schedule.owners` saying which
layer's part each event is: a layer's forward and backward, its parameters' storage, optimizer states and
temporaries) holds everything a deep one does once per layer. `deepened` inserts copies of the template layer's
parts next to it in every pass over the layers (ascending in forward, descending in backward), each copy's tensors
with keys of their own, and each reference from one layer to another (a layer's forward freeing the previous
layer's gathered unit, its backward freeing its own forward's tensors, the next layer's reduce-scatter input)
moved with it. `whole_from_template` accepts the result only where the same rule reproduces a schedule really built
deeper (the engine's check: 8 layers, the draft's depth), event for event; the schedule is built in full otherwise.
The copies past the first two are laid out by `native_events.repeat_events` (its Python twin where no C compiler was
found): their keys all move by one layer's worth from one copy to the next.

An 80-layer schedule deepened takes about 0.6 of its build, the two shallow builds and the check included
(benchmarks/deepen.md: 149 of the CI matrix's set-ups on deep models deepened, every one event for event the built
schedule; the plans' and estimates' JSON byte-identical).

Known Limitations: only layers of one kind (alike_layers): a model whose layers differ (cross-attention layers, dense
and MoE layers, every k-th layer checkpointed) is built in full. Anything that grows with depth outside a layer's
part (DDP's gradient buckets, DeepSpeed's flat buffers, TRL's reference copy, an optimizer whose step events do not
say their parameter) fails the check and is built in full too. A depth-dependent difference that the check's three
extra layers do not show (a threshold crossed only deeper) would not be seen; the step's own code has none known
(tests/estimator/test_deepen.py and benchmarks/deepen_check.py compare whole schedules both ways).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from itertools import accumulate

from llmem.estimator.events import NATIVE_EVENTS, Schedule
from llmem.estimator.identity_cache import IdentityCache
from llmem.memory.activations.profile import ActivationProfile
from llmem.model.anatomy import ModelAnatomy

SHALLOW_LAYERS = 5            # built, and deepened from layer TEMPLATE_LAYER; checked against a deeper build
TEMPLATE_LAYER = 2
# a schedule at least this deep is deepened (the two shallow builds and the check cost about as much as building
# 32 layers: Llama-3.1-8B's schedules were as fast either way, an 80-layer one about twice as fast deepened)
DEEPEN_FROM_LAYERS = 40
_LAYER_MARK = re.compile(r"^(.*layer )(\d+)$")
_LAYER_NUMBER = re.compile(r"\.\d+\.")

Event = tuple[int, int, int, int, str]
Run = tuple[int, int, int | None]          # (first event, end, owner): consecutive events of one layer (or None)


class _Shallow:
    """The shallow schedule read once: its runs, and each allocated key's layer and place among that layer's."""

    def __init__(self, sch: Schedule) -> None:
        self.events: list[Event] = sch.events
        self.owner_of: dict[int, int | None] = {}     # key -> the layer whose part allocated it
        self.place: dict[int, int] = {}                # key -> its index among its layer's allocations
        self.allocs: dict[int, list[int]] = {}         # layer -> its keys, in allocation order
        self.runs: list[Run] = self._split(sch.owners)
        self._distinct: dict[int, list[tuple[int, int, int]]] = {}

    def distinct(self, k: int) -> list[tuple[int, int, int]]:
        """Run k's keys of a layer's tensors, each once: (key, its layer, its place among that layer's)."""
        got = self._distinct.get(k)
        if got is None:
            start, end, _ = self.runs[k]
            owner_of, place = self.owner_of, self.place
            keys = dict.fromkeys(e[1] for e in self.events[start:end])
            got = self._distinct[k] = [(key, owner_of[key], place[key]) for key in keys
                                       if owner_of[key] is not None]
        return got

    def _split(self, owners: list[tuple[int, int | None]]) -> list[Run]:
        """Runs of one owner: a layer part's events, and each free outside one counted as its tensor's layer's."""
        runs: list[Run] = []
        changes = iter(owners + [(len(self.events) + 1, None)])
        ctx = None
        nxt, nxt_owner = next(changes)
        start, cur = 0, None
        owner_of, place, allocs = self.owner_of, self.place, self.allocs
        for i, (sign, key, _, _, _) in enumerate(self.events):
            while i >= nxt:
                ctx = nxt_owner
                nxt, nxt_owner = next(changes)
            if sign > 0:
                owner_of[key] = o = ctx
                if ctx is not None:
                    mine = allocs.setdefault(ctx, [])
                    place[key] = len(mine)
                    mine.append(key)
            else:
                o = ctx if ctx is not None else owner_of[key]
            if o != cur:
                if i > start:
                    runs.append((start, i, cur))
                start, cur = i, o
        if len(self.events) > start:
            runs.append((start, len(self.events), cur))
        return runs


class _Deepening:
    """`depth` -> `layers`: layer `t`'s parts copied n = layers - depth times; the shallow layers above t move up
    by n: deep layer L is made from shallow layer L (L <= t), t (a copy, t < L <= t + n) or L - n."""

    def __init__(self, shallow: _Shallow, depth: int, layers: int, t: int) -> None:
        self.s, self.layers, self.t, self.n = shallow, layers, t, layers - depth
        self.copy_keys = len(shallow.allocs.get(t, ()))
        self.base = max(shallow.owner_of, default=-1) + 1      # the copies' keys: after every shallow one

    def emitted_as(self, k: int) -> list[int | None] | None:
        """The deep layers run k of the shallow schedule is emitted as, in order (None: the step's own)."""
        runs, t, n = self.s.runs, self.t, self.n
        o = runs[k][2]
        if o is None:
            return [None]
        if o != t:
            return [o if o < t else o + n]
        before = runs[k - 1][2] if k > 0 else None
        after = runs[k + 1][2] if k + 1 < len(runs) else None
        up, down = before == t - 1 or after == t + 1, before == t + 1 or after == t - 1
        if up == down:
            return None               # not in a pass over the layers: the rule does not say where copies go
        order = list(range(t, t + n + 1))
        return order if up else order[::-1]

    def middle(self, k: int) -> dict[int, int] | None:
        """For template run k's copies 2 .. n-1, whose references all land in copies: each layer key's number in
        copy 0 (a copy's is that plus the copy's index x copy_keys); None where a reference reaches further than
        the next layer."""
        t, base, width = self.t, self.base, self.copy_keys
        moved = {}
        for key, tau, at in self.s.distinct(k):
            delta = tau - t
            if abs(delta) > 1:
                return None
            moved[key] = base + (delta - 1) * width + at
        return moved

    def remapped(self, k: int, layer: int | None) -> list[Event] | None:
        """Run k's events as deep layer `layer`'s (None: where a reference has no counterpart). A key of shallow
        layer tau read by layer o's part is, in deep layer L's copy of it, the same tensor of deep layer
        L + tau - o: the template's copies' keys are numbered after the shallow ones, the other layers keep
        theirs (the one at the same place among their allocations where the layer moved)."""
        s, (start, end, o) = self.s, self.s.runs[k]
        part = s.events[start:end]
        if layer is None:
            return part
        t, n, base, width, allocs = self.t, self.n, self.base, self.copy_keys, s.allocs
        moved: dict[int, int] = {}
        for key, tau, at in s.distinct(k):
            target = layer + tau - o
            if not 0 <= target < self.layers:
                return None
            src = target if target <= t else t if target <= t + n else target - n
            if src != tau and len(allocs.get(src, ())) != len(allocs[tau]):
                return None
            if t < target <= t + n:
                moved[key] = base + (target - t - 1) * width + at
            elif src != tau:
                moved[key] = allocs[src][at]
        if not moved:
            return part
        get = moved.get
        return [(a, get(b, b), c, d, e) for a, b, c, d, e in part]


def deepened(sch: Schedule, depth: int, layers: int, template: int = TEMPLATE_LAYER) -> Schedule | None:
    """`sch` (built with `depth` decoder layers) with `layers` of them: layer `template`'s parts repeated (None where
    its events do not split so: a layer part outside a pass over the layers, a reference with no counterpart)."""
    return _deepened(_Shallow(sch), sch, depth, layers, template)


def _deepened(shallow: _Shallow, sch: Schedule, depth: int, layers: int, template: int) -> Schedule | None:
    if layers < depth:
        return None
    plan = _Deepening(shallow, depth, layers, template)
    out = _Output(shallow, sch.marks)
    for k in range(len(shallow.runs)):
        order = plan.emitted_as(k)
        if order is None:
            return None
        middle = plan.middle(k) if len(order) > 3 else None
        if middle is None:
            firsts, copies, lasts = order, [], []
        else:      # the first two and the last copies reach outside the copies: laid out one by one
            up = order[0] == template
            firsts, lasts = (order[:2], order[-1:]) if up else (order[:1], order[-2:])
            copies = [layer - template for layer in order[len(firsts):len(order) - len(lasts)]]
        for layer in firsts:
            if not out.emit(k, layer, plan.remapped(k, layer)):
                return None
        if copies:
            out.repeat(k, middle, copies, plan.copy_keys, template)
        for layer in lasts:
            if not out.emit(k, layer, plan.remapped(k, layer)):
                return None
    return out.schedule(sch)


class _Output:
    """The deep schedule's events, marks (each layer's renamed) and phases, laid out run by run."""

    def __init__(self, shallow: _Shallow, marks: list[tuple[int, str]]) -> None:
        self.s = shallow
        self.events: list[Event] = []
        self.marks: list[tuple[int, str]] = []
        self.starts: dict[int, int] = {}                # shallow run -> where its first emission begins
        self.mark_runs = _marks_by_run(marks, shallow.runs, len(shallow.events))

    def emit(self, k: int, layer: int | None, part: list[Event] | None) -> bool:
        if part is None:
            return False
        self._marks(k, layer, len(self.events))
        self.events += part
        return True

    def repeat(self, k: int, middle: dict[int, int], copies: list[int], width: int, template: int) -> None:
        """Copies `copies` of template run k (its keys of the copies: middle[key] + copy x width)."""
        start, end, _ = self.s.runs[k]
        part = self.s.events[start:end]
        if self.mark_runs.get(k):
            for i, c in enumerate(copies):
                self._marks(k, template + c, len(self.events) + i * len(part))
        _repeat_events(part, middle, [c * width for c in copies], self.events)

    def _marks(self, k: int, layer: int | None, at: int) -> None:
        self.starts.setdefault(k, at)
        start, _, owner = self.s.runs[k]
        self.marks += [(i - start + at, _renamed(label, owner, layer)) for i, label in self.mark_runs.get(k, ())]

    def schedule(self, sch: Schedule) -> Schedule:
        shallow_end, end = len(self.s.events), len(self.events)
        marks = self.marks + [(end + i - shallow_end, label) for i, label in self.mark_runs.get(-1, ())]
        phases = [(_moved(i, self.s.runs, self.starts, end, shallow_end), name) for i, name in sch.phase_starts]
        return _schedule(sch.min_bytes, self.events, phases, marks)


def whole_from_template(build: Callable[[int], Schedule], layers: int,
                        check_layers: int = SHALLOW_LAYERS + 2) -> Schedule | None:
    """The schedule with `layers` decoder layers, deepened from one `build(SHALLOW_LAYERS)` made, where deepening it
    to `check_layers` reproduces `build(check_layers)` event for event (its phases and marks too); else None."""
    if layers < DEEPEN_FROM_LAYERS:
        return None
    small = build(SHALLOW_LAYERS)
    shallow = _Shallow(small)
    check = _deepened(shallow, small, SHALLOW_LAYERS, check_layers, TEMPLATE_LAYER)
    if check is None or not same_schedule(check, build(check_layers)):
        return None
    return _deepened(shallow, small, SHALLOW_LAYERS, layers, TEMPLATE_LAYER)


def alike_layers(anatomy: ModelAnatomy, act: ActivationProfile) -> bool:
    """Whether the step's decoder layers are alike from the template layer on: one kind of layer, each
    checkpointed or none, the same parameters in each (not: an adapter on some layers only, a model whose first
    layers are dense and the rest MoE), none graphless from the template on."""
    kinds = act.kinds
    if kinds.cross_layers or kinds.graphless_layers > TEMPLATE_LAYER or (act.grad_ckpt and act.ckpt_every > 1):
        return False
    return _ALIKE.get(anatomy, "layers", lambda: len(set(layer_kinds(anatomy).values())) <= 1)


def layer_kinds(anatomy: ModelAnatomy) -> dict[int, tuple]:
    """Each decoder layer's parameters' kinds (ParamInfo.kind with the layer's number left out of the name, as a
    pipeline stage's sub-model names its layers by their number in the whole model), in order."""
    kinds: dict[int, list] = {}
    for p in anatomy.params:
        if p.layer_index is not None:
            kinds.setdefault(p.layer_index, []).append((_LAYER_NUMBER.sub(".#.", p.name, count=1), *p.kind[1:]))
    return {i: tuple(k) for i, k in kinds.items()}


_ALIKE: IdentityCache[bool] = IdentityCache(64)


def same_schedule(a: Schedule, b: Schedule) -> bool:
    """The same events (keys compared by the order of their allocations), phases and marks."""
    return (len(a.events) == len(b.events) and a.phase_starts == b.phase_starts and a.marks == b.marks
            and (mine := _canonical(a.events)) is not None and mine == _canonical(b.events))


def _canonical(events: list[Event]) -> list[Event] | None:
    """The events with each key replaced by the order of its allocation (None: a free of a key not allocated)."""
    ids: dict[int, int] = {}
    out = []
    for sign, key, size, stream, component in events:
        if sign > 0:
            ids[key] = len(ids)
        elif key not in ids:
            return None
        out.append((sign, ids[key], size, stream, component))
    return out


def _marks_by_run(marks: list[tuple[int, str]], runs: list[Run], end: int) -> dict[int, list[tuple[int, str]]]:
    """Each mark with the run it falls in (-1: after the last event)."""
    by_run: dict[int, list[tuple[int, str]]] = {}
    k = 0
    for i, label in marks:
        if i >= end:
            by_run.setdefault(-1, []).append((i, label))
            continue
        while runs[k][1] <= i:
            k += 1
        by_run.setdefault(k, []).append((i, label))
    return by_run


def _renamed(label: str, owner: int | None, layer: int | None) -> str:
    """A layer's mark ("layer 2", "no_grad layer 2") as deep layer `layer`'s."""
    m = _LAYER_MARK.match(label)
    if m is None or owner is None or int(m.group(2)) != owner:
        return label
    return f"{m.group(1)}{layer}"


def _moved(i: int, runs: list[Run], starts: dict[int, int], deep_end: int, shallow_end: int) -> int:
    """Where shallow event index `i` (a phase's first event) is in the deep schedule: in its run's first emission."""
    if i >= shallow_end:
        return deep_end + i - shallow_end
    k = next(k for k, (a, b, _) in enumerate(runs) if a <= i < b)
    return starts[k] + i - runs[k][0]


def _schedule(min_bytes: int, events: list[Event], phases: list[tuple[int, str]],
              marks: list[tuple[int, str]]) -> Schedule:
    out = Schedule(min_bytes)
    out.events = events
    out.phase_starts, out.marks = phases, marks
    out.peak_live_bytes, out.live_bytes = _live_bytes(events)
    return out


def _python_repeat_events(part: list[Event], moved: dict[int, int], shifts: list[int], out: list[Event]) -> None:
    """The Python twin of native_events.repeat_events."""
    for shift in shifts:
        out += [e if e[1] not in moved else (e[0], moved[e[1]] + shift, e[2], e[3], e[4]) for e in part]


def _python_live_bytes(events: list[Event]) -> tuple[int, int]:
    """The Python twin of native_events.live_bytes: the live tensor bytes' peak, and after the last event."""
    live = list(accumulate(sign * size for sign, _, size, _, _ in events))
    return max([0, *live]), live[-1] if live else 0


if NATIVE_EVENTS is not None:     # (the event log's compiled module, where it is in use)
    _repeat_events, _live_bytes = NATIVE_EVENTS.repeat_events, NATIVE_EVENTS.live_bytes
else:
    _repeat_events, _live_bytes = _python_repeat_events, _python_live_bytes
