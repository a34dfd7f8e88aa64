"""Parse the torchtitan 0.3 command line that `llmem plan --export torchtitan` writes in its header with torchtitan
0.3's own ConfigManager (tyro), and print what 0.3 would run: the activation checkpointing class, the batch, the
degrees. A manual check (torchtitan is not a dependency): its wheel and tyro in a folder of their own, torchtitan's
runtime-only imports (datasets, tokenizers, ...) stubbed, since only the config schema is read.

    mkdir -p /tmp/tt && cd /tmp/tt && pip download --no-deps torchtitan==0.3.0 && unzip -q torchtitan-*.whl \\
        && pip install --target /tmp/tt/site tyro
    llmem plan meta-llama/Llama-3.1-8B --gpus 4 --seq-len 4096 --grad-ckpt --export torchtitan /tmp/tt/a.toml
    PYTHONPATH=/tmp/tt:/tmp/tt/site .venv/bin/python benchmarks/torchtitan03_parse.py /tmp/tt/a.toml

prints e.g. `/tmp/tt/a.toml: FullAC.Config local_batch_size 6 global 24 seq 4096 dp_shard 4 tp 1 pp 1 cpu_offload
False`, or the one line saying why 0.3 cannot run the plan.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import shlex
import sys
import types
from unittest import mock

# torchtitan 0.3's imports that its config schema does not need (the trainer module imports them at its top)
STUBBED = {"spmd_types", "torchdata", "datasets", "tensorboard", "wandb", "einops", "tokenizers", "safetensors",
           "torch_checkpointing", "tiktoken", "blobfile", "fbgemm_gpu", "PIL", "torchao", "sentencepiece",
           "huggingface_hub", "transformers", "psutil", "tomli_w", "triton", "google"}
PREFIX = "# torchtitan 0.3+:"


class _StubModule(types.ModuleType):
    """A stubbed module: a class for a capitalised name (so that torchtitan can subclass it), else a mock."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__init__": lambda self, *a, **k: None}) if name[:1].isupper() else mock.MagicMock()
        setattr(self, name, value)
        return value


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self, is_package=True) if name.split(".")[0] in STUBBED else None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__, module.__spec__, module.__version__ = [], spec, "99.0"
        return module

    def exec_module(self, module) -> None:
        pass


def parse(path: str) -> str:
    from torchtitan.config.manager import ConfigManager

    line = next(x for x in open(path, encoding="utf-8") if x.startswith(PREFIX))[len(PREFIX):].strip()
    if line.startswith("cannot run"):
        return line
    words = shlex.split(line)
    cfg = ConfigManager().parse_args(words[words.index("torchtitan.train") + 1:])
    t, par = cfg.training, cfg.parallelism
    return (f"{type(cfg.activation_checkpoint).__qualname__} local_batch_size {t.local_batch_size} global "
            f"{t.global_batch_size} seq {t.seq_len} dp_shard {par.data_parallel_shard_degree} tp "
            f"{par.tensor_parallel_degree} pp {par.pipeline_parallel_degree} cpu_offload {t.enable_cpu_offload}")


if __name__ == "__main__":
    logging.disable(logging.CRITICAL)
    sys.meta_path.insert(0, _Stubs())
    for toml in sys.argv[1:]:
        print(f"{toml}: {parse(toml)}")
