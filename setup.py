"""The compiled replay loop (llmem/memory/native_replay.c): optional, as llmem.memory.phase_replay runs the same loop in
Python where no C compiler is found at install time. Everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("llmem.memory.native_replay", ["llmem/memory/native_replay.c"], optional=True,
                             extra_compile_args=["-O2"])])
