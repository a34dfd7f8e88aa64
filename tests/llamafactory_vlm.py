"""A LLaMA-Factory vision-language config through `llmem estimate --from` (one 1024x768 image a sample): the shared
harness of the families' --from tests (tests/model/test_llava_onevision.py, test_qwen3_vlm.py)."""

from __future__ import annotations

import json

from llmem.cli import main


def estimate_from_yaml(tmp_path, capsys, name: str, text: str) -> dict:
    """The JSON answer of `llmem estimate --from` a LLaMA-Factory file `name` holding `text`, which must succeed."""
    path = tmp_path / name
    path.write_text(text)
    code = main(["estimate", "--from", str(path), "--images-per-sample", "1", "--image-size", "1024x768", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)
