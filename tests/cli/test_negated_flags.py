"""Every on/off option has both forms on the command line (argparse's BooleanOptionalAction), so a choice a
`--from` file makes can be turned off as well as on, and flags override the file both ways."""

from __future__ import annotations

import pytest
from published_configs import CONFIGS  # noqa: E402

from llmem.cli import build_parser
from llmem.cli.options import setup_and_source
from llmem.setup.training import option_fields

# axolotl's Llama-3 QLoRA example: `gradient_checkpointing: true`, `sample_packing: true`, `load_in_4bit: true`
AXOLOTL_QLORA = CONFIGS / "axolotl" / "examples" / "llama-3" / "qlora.yml"


def _setup(*argv: str):
    return setup_and_source(build_parser().parse_args(["estimate", *argv]))[0]


def _boolean_fields() -> list[tuple[str, str]]:
    """(field, flag) of every set-up field asked for by an on/off switch."""
    out = []
    for f in option_fields():
        opt = f.metadata.get("option")
        if opt is not None and opt.kind in ("switch", "negate"):
            flag = opt.flag or "--" + f.name.replace("_", "-")
            out.append((f.name, "--" + flag.removeprefix("--").removeprefix("no-")))
    return out


# what a switch needs beside it for the set-up to be built at all
QLORA = ("--qlora", "--lora-rank", "8")
CONTEXT = {"kbit_upcast": QLORA, "double_quant": QLORA, "offload_param": ("--method", "fsdp", "--gpus", "2"),
           "use_vllm": ("--objective", "grpo"), "vllm_enable_sleep_mode": ("--objective", "grpo", "--use-vllm"),
           "precompute_ref_log_probs": ("--objective", "dpo"), "float8_all_gather": ("--float8", "tensorwise")}


def test_every_switch_has_both_forms():
    fields = _boolean_fields()
    assert len(fields) >= 10          # grad_ckpt, fused_ce, packing, offload_*, kbit_upcast, double_quant, ...
    for name, flag in fields:
        context = CONTEXT.get(name, ())
        on = _setup("tiny-llama", *context, flag)
        off = _setup("tiny-llama", *context, "--no-" + flag.removeprefix("--"))
        assert (getattr(on, name), getattr(off, name)) == (True, False), flag


@pytest.mark.skipif(not AXOLOTL_QLORA.exists(), reason="../shared/data/configs is not beside the repository")
def test_a_files_choice_is_turned_off_by_the_negated_flag():
    assert _setup("meta-llama/Llama-3.1-8B", "--from", str(AXOLOTL_QLORA)).grad_ckpt is True
    off = _setup("meta-llama/Llama-3.1-8B", "--from", str(AXOLOTL_QLORA), "--no-grad-ckpt", "--no-packing")
    assert (off.grad_ckpt, off.packing) == (False, False)
    assert off.quant_base == "nf4"       # the rest of the file still read


def test_the_last_form_given_wins():
    assert _setup("tiny-llama", "--no-grad-ckpt", "--grad-ckpt").grad_ckpt is True
    assert _setup("tiny-llama", "--grad-ckpt", "--no-grad-ckpt").grad_ckpt is False


def test_double_quant_forms_under_qlora():
    """--no-double-quant turns off bitsandbytes' nested quantisation of the NF4 scales; it needs --qlora, while the
    default form alone changes nothing."""
    assert _setup("tiny-llama", "--qlora", "--lora-rank", "8", "--no-double-quant").double_quant is False
    assert _setup("tiny-llama", "--double-quant").double_quant is True
