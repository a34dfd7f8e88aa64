"""The set-up's record on the set-up floor: the set-up as every engine's result reports it.

The set-up as every engine reports it: the user's set-up with what resolving it decided (the model's name, the
layout, the GPU, the attention kernel that runs, the adapters peft builds) and the facts the numbers depend on. One
record, filled one way (llmem.model.resolved.setup_record), in every MemoryResult; `describe()` says it in words
(the tables' and the plots' titles)."""

from __future__ import annotations

from dataclasses import dataclass

from llmem.setup.training import LATER_FIELDS, TrainingSetup


@dataclass(frozen=True)
class SetupRecord:
    setup: TrainingSetup       # as resolved: model name, method, gpus, gpus_per_node, tp, gpu and attn as they run
    model_type: str
    total_params: int
    trainable_params: int
    dp: int
    nodes: int
    gpu_memory_bytes: int
    cuda_context_bytes: int
    layout: str = ""                      # the resolved layout's label, as plan tables name it: "fsdp (4)"
    adapter: str = ""                     # what trains besides nothing: "LoRA", "QLoRA", "DoRA", "IA3", ...; "" (full)
    adapter_rank: int = 0                 # LoRA / DoRA rank (0: not a low-rank adapter)
    adapter_targets: tuple[str, ...] = ()  # the adapted modules' names (q_proj, v_proj, ...)
    saved_modules: tuple[str, ...] = ()    # peft's modules_to_save: modules trained whole beside the adapters
    virtual_tokens: int = 0               # prompt tuning: prepended embeddings
    attn_requested: str = ""              # --attn as asked (setup.attn is the kernel that runs)

    def __getattr__(self, name: str):
        # the set-up's own fields read through the record (record.model, record.batch_size, ...)
        if name == "setup":
            raise AttributeError(name)
        return getattr(self.setup, name)

    def to_dict(self) -> dict:
        out = self.setup.to_dict()
        # after the keys an earlier llmem printed (those of SHOWN_WHEN_SET only where set)
        later = {name: out.pop(name) for name in LATER_FIELDS if name in out}
        out.update(model_type=self.model_type, total_params=self.total_params,
                   trainable_params=self.trainable_params, dp=self.dp, nodes=self.nodes,
                   gpu_memory_bytes=self.gpu_memory_bytes, cuda_context_bytes=self.cuda_context_bytes,
                   layout=self.layout, layout_text=self.layout_text(), adapter=self.adapter or None,
                   adapter_rank=self.adapter_rank or None, adapter_targets=list(self.adapter_targets),
                   virtual_tokens=self.virtual_tokens, attn_requested=self.attn_requested or self.setup.attn,
                   attn_kernel=self.setup.attn, description=self.describe())
        if self.saved_modules:          # (only where set: the answers without them keep their keys)
            out["saved_modules"] = list(self.saved_modules)
        out.update(later)
        return out

    # ------------------------------------------------------------------ in words
    def layout_text(self) -> str:
        """'single on 1× A100-80GB', 'fsdp on 4× H100-80GB', 'fsdp+tp (dp 2 × tp 4) on 8× H100-80GB'."""
        s = self.setup
        tp = s.tp or 1
        detail = f" (dp {self.dp} × tp {tp})" if self.dp > 1 and tp > 1 else ""
        if max(s.pp, s.cp, s.ep) > 1:   # the layout's own label names every axis
            detail = self.layout[len(s.method):] if self.layout.startswith(s.method) else f" ({self.layout})"
        nodes = f", {self.nodes} nodes of {s.gpus_per_node}" if self.nodes > 1 else ""
        return f"{s.method}{detail} on {s.gpus}× {s.gpu}{nodes}"

    def adapter_text(self) -> str:
        """What trains: 'LoRA r16 on c_attn', 'QLoRA (nf4 base, double quant) r8 on q_proj, v_proj', 'IA3 on
        k_proj, v_proj, down_proj', 'prompt tuning (20 virtual tokens)', or 'full fine-tuning'."""
        s = self.setup
        if not self.adapter:
            return "full fine-tuning"
        kind = self.adapter
        quant = s.quant_spec
        if quant.quantised:
            double = ", double quant" if quant.double_quant_optional and s.double_quant else ""
            kind += f" ({quant.base_text}{double})"
        if quant.kbit_prep and not s.kbit_upcast:
            kind = kind[:-1] + ", no kbit upcast)"
        if self.adapter_rank:
            kind += f" r{self.adapter_rank}"
        if s.lora_dropout:
            kind += f" dropout {s.lora_dropout:g}"
        if self.virtual_tokens:
            kind += f" ({self.virtual_tokens} virtual tokens)"
        if self.adapter_targets:
            kind += " on " + ", ".join(self.adapter_targets)
        if self.saved_modules:
            kind += "; " + ", ".join(self.saved_modules) + " trained whole (modules_to_save)"
        return kind

    def trainable_text(self) -> str:
        """'589,824 trainable params (0.474%)'; under full fine-tuning the count alone."""
        trained = f"{self.trainable_params:,} trainable params"
        if not self.adapter or not self.total_params:
            return trained
        return f"{trained} ({100 * self.trainable_params / self.total_params:.3g}%)"

    def describe(self, layout: bool = True, shape: bool = True) -> list[str]:
        """The set-up as phrases, in the order titles show them: model, layout, shape, precision, optimizer,
        adapters and their trainable count, and the activation options that change memory, the attention kernel
        last. layout / shape False: without those two (a plan searches them)."""
        s = self.setup
        optimizer = s.optimizer + (" in backward" if s.optimizer_in_backward else "") \
            + (" offloaded to CPU" if s.offload_optimizer else "")
        parts = [s.model]
        if layout:
            parts.append(self.layout_text())
        if shape:
            parts.append(f"batch {s.batch_size} × seq {s.seq_len}")
        parts += [s.precision, optimizer, self.adapter_text(), self.trainable_text()]
        if s.grad_ckpt:
            parts.append("grad-ckpt" + (f" every {s.ckpt_every} layers" if s.ckpt_every > 1 else "")
                         + (f" ({s.ac_policy} policy)" if s.ac_policy != "full" else ""))
        if s.fused_ce:
            parts.append("fused CE")
        if s.logits_dtype != "fp32":
            parts.append(f"loss on {s.logits_dtype}-dtype logits")
        if s.liger != "none":
            parts.append(f"Liger {s.liger.replace(',', ', ')}")
        if s.float8 != "none":
            parts.append(f"float8 {s.float8}" + (" (float8 all-gather)" if s.float8_all_gather else ""))
        if s.offload_activations:
            parts.append("activations offloaded to CPU")
        if s.packing:
            parts.append("packing")
        if s.expandable_segments:
            parts.append("expandable segments")
        requested = self.attn_requested or s.attn
        parts.append(f"attn {s.attn}" + (f" ({requested} unsupported)" if requested != s.attn else ""))
        return parts
