"""--float8 in the traced step: torchao's own Float8Linear (its casts, torch._scaled_mm's meta kernel) on fake
tensors, against the estimate. Needs torchao (pip install 'llmem[float8]'): skipped without it."""

from __future__ import annotations

import pytest

from llmem.errors import LlmemError
from llmem.validate.compare import COUNTERS, compare_one
from llmem.validate.matrices import FLOAT8_MATRIX, label


def test_without_torchao_the_trace_says_how_to_install_it(monkeypatch):
    """The estimate needs no torchao; the trace names the extra that brings it."""
    import builtins

    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    from torch import nn

    from llmem.runtime.float8 import install_float8
    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(LlmemError, match=r"pip install 'llmem\[float8\]'"):
        install_float8(nn.Sequential(nn.Linear(16, 16)), "tensorwise", False)


def test_convert_swaps_every_decoder_linear_but_the_lm_head():
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    from llmem.runtime.build import meta_model_for
    from llmem.runtime.float8 import install_float8
    from llmem.setup.training import TrainingSetup

    model = meta_model_for(TrainingSetup(model="tiny-llama", precision="bf16", float8="rowwise"))
    assert install_float8(model, "rowwise", False) == 4 * 7
    assert not isinstance(model.lm_head, Float8Linear)


@pytest.mark.parametrize("setup", FLOAT8_MATRIX, ids=label)
def test_estimate_agrees_with_the_float8_trace_within_2_percent(setup):
    pytest.importorskip("torchao.float8")
    row = compare_one(setup, "trace")
    assert not row.error, row.error
    for counter in COUNTERS[:2]:
        est, truth = getattr(row.estimate, counter), getattr(row.truth, counter)
        assert abs(est - truth) <= 0.02 * truth, (counter, est, truth)
