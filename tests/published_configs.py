"""Where the tests read the training configs the frameworks publish: ../shared/data/configs beside the checkout, read
in place (its INDEX.md: exact upstream files, not to be copied into the project), or the folder $LLMEM_CONFIGS names.

A plain clone has no ../shared: the tests that read these files skip then, each with SKIP_REASON, and conftest.py
says so in the run's header and in a summary at its end (how many, why, how to run them)."""

from __future__ import annotations

import os
from pathlib import Path

CONFIGS_ENV = "LLMEM_CONFIGS"
CONFIGS = Path(os.environ.get(CONFIGS_ENV) or Path(__file__).resolve().parents[2] / "shared" / "data" / "configs")
SKIP_REASON = (f"the frameworks' published configs are not at {CONFIGS} (a plain clone has no ../shared/data/configs "
               f"beside it): set {CONFIGS_ENV} to a copy of that folder to run these tests")


def present() -> bool:
    return CONFIGS.is_dir()
