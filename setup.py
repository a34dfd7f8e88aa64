"""The compiled replay loop (llmem/memory/_replay.c): optional, as llmem.memory.phase_replay runs the same loop in
Python where no C compiler is found at install time. Everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("llmem.memory._replay", ["llmem/memory/_replay.c"], optional=True,
                             extra_compile_args=["-O2"])])
