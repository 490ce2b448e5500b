"""Full copies of the base model's end layers that PEFT writes beside their LoRA.

PEFT's `save_pretrained(save_embedding_layers="auto")`, the default, also saves the whole
base weight of a targeted `embed_tokens` or `lm_head` (`base_model.model.model.
embed_tokens.base_layer.weight`, `base_model.model.lm_head.base_layer.weight`; with tied
embeddings the head's copy is the embedding). Such an adapter is served when each copy is
the base model's own layer: here, torch-free, its name, shape and dtype are checked (the
end it copies must be a target of the adapter, the shape the unpadded [vocab, hidden]);
its values are compared with the base checkpoint where the engine reads the weights
(engine/lora/base_copies.py). A copy is never built into the served weights.
"""
from __future__ import annotations

import re

from loramux_core.adapter.safetensors_buffer import TensorInfo, is_float
from loramux_core.errors import AdapterError
from loramux_core.model.lora_targets import END_GROUP

# the copy's key -> the end target it copies
_COPY_KEY = re.compile(r"^(?:base_model\.model\.)?(?:(?P<head>lm_head)|model\.(?P<embed>"
                       r"embed_tokens))\.base_layer\.weight$")


def copied_end(key: str) -> str | None:
    """The end target (`lm_head`, `embed_tokens`) whose base layer `key` copies, or None."""
    m = _COPY_KEY.match(key)
    return None if m is None else (m["head"] or m["embed"])


def base_weight_names(module: str, tied: bool) -> tuple[str, ...]:
    """The names the base checkpoint may hold the copied layer under, in order: a model
    with tied embeddings has no lm_head weight of its own."""
    embed = ("model.embed_tokens.weight",)
    return embed if module == "embed_tokens" or tied else ("lm_head.weight", *embed)


def check_copies(copies: dict[str, str], shapes: dict[str, TensorInfo], targets, model_cfg,
                 file: str) -> tuple[tuple[str, str], ...]:
    """((module, key), ...) of the base-layer copies in the header: each for an end the
    adapter targets, shaped [vocab_size, hidden_size], of a floating dtype; AdapterError
    naming the tensor otherwise."""
    ends = {module for layer, module in targets if layer == END_GROUP}
    want = (model_cfg.vocab_size, model_cfg.hidden_size)
    out = []
    for module, key in sorted(copies.items()):
        info = shapes[key]
        if module not in ends:
            raise AdapterError(f"tensor {key!r} is a full copy of the base {module}, which "
                               f"target_modules does not select", feature="save_embedding_layers",
                               file=file)
        if info.shape != want:
            raise AdapterError(f"tensor {key!r} is a copy of the base {module} of shape "
                               f"{list(info.shape)}, but the base layer is {list(want)} (an "
                               f"adapter for a resized vocabulary is not served over this "
                               f"base model)", feature="save_embedding_layers", file=file)
        if not is_float(info):
            raise AdapterError(f"tensor {key!r} has dtype {info.dtype}, expected a floating "
                               f"type", feature="dtype", file=file)
        out.append((module, key))
    return tuple(out)


def copies_bytes(model_cfg, ends) -> int:
    """Room the copies of `ends` (end targets) can take in a weights file (float64)."""
    return len(set(ends)) * model_cfg.vocab_size * model_cfg.hidden_size * 8
