"""peft's adapter parameters read from their names, in one place: which part of which tuner a parameter is, and the
module it adapts.

peft names a tuner layer's parameters `<adapted module>.<part>.<adapter name>[.weight]` (peft/tuners/lora/layer.py
LoraLayer.adapter_layer_names, ia3/layer.py IA3Layer.adapter_layer_names): LoRA's down and up projections
`q_proj.lora_A.default.weight`, `q_proj.lora_B.default.weight` (nn.Linear in nn.ModuleDict), DoRA's
`q_proj.lora_magnitude_vector.default.weight`, IA3's vector `k_proj.ia3_l.default` (nn.ParameterDict: [out, 1]
scaling an output, [1, in] scaling a feed-forward input).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class AdapterPart:
    """One kind of adapter parameter, by the piece of its name peft gives it (its attribute on the tuner layer)."""
    mark: str       # the piece of the parameter's name: `<module><mark><adapter name>...`


LORA_A = AdapterPart(mark=".lora_A.")    # LoRA: [rank, in]: reads the module's input
LORA_B = AdapterPart(mark=".lora_B.")    # LoRA: [out, rank]: reads lora_A's output
IA3_L = AdapterPart(mark=".ia3_l.")      # IA3: [out, 1] or [1, in]
ADAPTER_PARTS = (LORA_A, LORA_B, IA3_L)

# every parameter a LoRA (lora_A/B, lora_embedding_A/B, DoRA's lora_magnitude_vector) or IA3 tuner layer adds
ADAPTER_MARKS = (".lora_", IA3_L.mark)


def is_adapter_param(name: str) -> bool:
    """A parameter of a peft LoRA / DoRA / IA3 tuner layer (not the base layer's own weight or bias)."""
    return any(mark in name for mark in ADAPTER_MARKS)


def adapter_part(name: str) -> AdapterPart | None:
    """Which of ADAPTER_PARTS parameter `name` is (None: another parameter)."""
    return next((part for part in ADAPTER_PARTS if part.mark in name), None)


def adapted_module(name: str) -> str:
    """The local name of the module an adapter parameter adapts (`q_proj` for `...self_attn.q_proj.lora_A...`)."""
    for part in ADAPTER_PARTS:
        name = name.split(part.mark)[0]
    return name.rsplit(".", 1)[-1]


def partner(name: str, part: AdapterPart) -> str:
    """The name of the same tuner layer's `part` parameter (lora_A's lora_B)."""
    current = adapter_part(name)
    return name.replace(current.mark, part.mark) if current is not None else name


def reads_module_input(name: str, shape: tuple[int, ...]) -> bool:
    """The adapter itself reads the adapted module's input: lora_A, or IA3's vector scaling a feed-forward input
    ([1, in])."""
    part = adapter_part(name)
    return part is LORA_A or part is IA3_L and shape[0] == 1


# peft's LoRA on an nn.Embedding (peft/tuners/lora/layer.py Embedding): `embed_tokens.lora_embedding_A.default`
# [r, num_embeddings] and `embed_tokens.lora_embedding_B.default` [embedding_dim, r], nn.Parameters in ParameterDicts
EMBEDDING_A = ".lora_embedding_A."
EMBEDDING_B = ".lora_embedding_B."


def is_embedding_adapter(name: str) -> bool:
    """A parameter of peft's LoRA on an embedding (its A or B)."""
    return EMBEDDING_A in name or EMBEDDING_B in name
