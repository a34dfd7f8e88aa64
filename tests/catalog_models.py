"""The catalog as pytest parameters for the per-model sweeps: the first model of each family (model_type) runs by
default, every other model under `-m slow`. The families share their anatomy code path; what differs within one is
sizes, which the default run's first member and the slow run's rest cover (CI time: 50 models x dozens of estimates
each was the costliest part of the default run)."""

from __future__ import annotations

import pytest

from llmem.model.catalog import catalog, load_config_dict


def catalog_params() -> list:
    """Each catalog hub id as a pytest.param, marked slow unless it is the first of its model_type."""
    seen: set[str] = set()
    params = []
    for entry in catalog().values():
        family = load_config_dict(entry).get("model_type", "")
        first = family not in seen
        seen.add(family)
        params.append(pytest.param(entry.hub_id, marks=() if first else pytest.mark.slow))
    return params
