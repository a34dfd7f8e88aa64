"""`SharedReplays`: the step replays one planner's searches share. Set-ups that differ only in fields no step schedule
reads (SCHEDULE_FREE_FIELDS) lay out the same allocation events, so the replay of those events through the allocator
model (uncapped: the capacity the step is then decided at is applied after it) is made once and read by each.

A GRPO plan with colocated vLLM searches every layout at up to 17 vLLM utilizations (llmem.planner.generation_plan):
vLLM's pool is sized outside torch's allocator (llmem.estimator.generation.colocated_pool) and only narrows the
capacity the trainer's step is decided at, so the trainer's schedule, and its uncapped replay, is the same at each.
"""

from __future__ import annotations

from collections.abc import Callable

from llmem.estimator.events import Replay
from llmem.estimator.identity_cache import IdentityCache
from llmem.model.resolved import ResolvedSetup
from llmem.setup.training import FLAT_ORDER, TrainingSetup

# set-up fields no step schedule reads (tests/estimator/test_shared_replays.py lays the schedules out at two values
# of each and finds the same events): GRPOConfig's vllm_gpu_memory_utilization, the colocated pool's share of the
# device (vLLM's own memory, beside the allocator's)
SCHEDULE_FREE_FIELDS = ("vllm_gpu_memory_utilization",)
KEPT_REPLAYS = 256      # a plan's distinct schedules (a few hundred at most); each replay's phases are small


def schedule_key(setup: TrainingSetup) -> tuple:
    """The set-up's fields a step schedule may read (every field but SCHEDULE_FREE_FIELDS), its shape included."""
    return tuple(getattr(setup, name) for name in FLAT_ORDER if name not in SCHEDULE_FREE_FIELDS)


class SharedReplays:
    """Uncapped replays of step schedules kept per (trained model, base model, set-up less SCHEDULE_FREE_FIELDS,
    layout, GPU, depth): the models compared by identity and held by the entry (their ids cannot be reused while it
    lives), the rest by value."""

    def __init__(self, size: int = KEPT_REPLAYS) -> None:
        self._kept: IdentityCache[tuple[object, Replay]] = IdentityCache(size)

    def replay(self, r: ResolvedSetup, layers: int | None, work_out: Callable[[], Replay]) -> Replay:
        """The replay of `r`'s step over its first `layers` decoder layers (None: all), `work_out()` where no set-up
        with the same schedule key has been replayed at that depth."""
        key = (schedule_key(r.setup), r.layout, r.gpu, id(r.base), layers)
        return self._kept.get(r.anatomy, key, lambda: (r.base, work_out()))[1]

    def __len__(self) -> int:
        return len(self._kept)
