"""The catalog as pytest parameters for the per-model sweeps: the first model of each family (model_type) runs by
default, every other model under `-m slow`. The families share their anatomy code path; what differs within one is
sizes, which the default run's first member and the slow run's rest cover (CI time: 50 models x dozens of estimates
each was the costliest part of the default run)."""

from __future__ import annotations

import pytest

from llmem.model.catalog import catalog, load_config_dict
from llmem.model.vision import vision_spec

# a vision-language model's step takes images, which these sweeps' text-only set-ups do not give (refused:
# llmem.model.vision_inputs); tests/estimator/test_vlm_estimate.py estimates it with them
_VLM_SKIP = pytest.mark.skip(reason="a vision-language model's step needs images (tests/estimator/test_vlm_estimate.py)")


def text_models() -> list:
    """The catalog's text-only hub ids (its vision-language ones aside)."""
    return [e.hub_id for e in catalog().values() if vision_spec(load_config_dict(e).get("model_type", "")) is None]


def catalog_params() -> list:
    """Each catalog hub id as a pytest.param, marked slow unless it is the first of its model_type (a vision-language
    one skipped: its step needs images)."""
    seen: set[str] = set()
    params = []
    for entry in catalog().values():
        family = load_config_dict(entry).get("model_type", "")
        if vision_spec(family) is not None:
            params.append(pytest.param(entry.hub_id, marks=_VLM_SKIP))
            continue
        first = family not in seen
        seen.add(family)
        params.append(pytest.param(entry.hub_id, marks=() if first else pytest.mark.slow))
    return params
