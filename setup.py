"""The compiled replay loop (llmem/memory/native_replay.c) and the schedule's event log (llmem/estimator/native_events.c):
optional, as llmem.memory.phase_replay and llmem.estimator.events run the same code in Python where no C compiler is
found at install time. Everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("llmem.memory.native_replay", ["llmem/memory/native_replay.c"], optional=True,
                             extra_compile_args=["-O2"]),
                   Extension("llmem.estimator.native_events", ["llmem/estimator/native_events.c"], optional=True,
                             extra_compile_args=["-O2"])])
