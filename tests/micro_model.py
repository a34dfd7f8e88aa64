"""A micro Llama config written to a file, for tests that need a model llmem builds in milliseconds."""

from __future__ import annotations

import json

MICRO = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
         "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
         "torch_dtype": "bfloat16"}


def write_config(tmp_path_factory, fields: dict = MICRO) -> str:
    """`fields` as a config.json in a fresh folder; its path."""
    path = tmp_path_factory.mktemp("micro") / "config.json"
    path.write_text(json.dumps(fields))
    return str(path)
