"""adapter_config.json of a PEFT LoRA adapter: parsing, refusals, and PEFT's matching rules.

Everything here works on module names as PEFT sees them on a Hugging Face causal LM
(`model.layers.3.self_attn.q_proj`), so target, rank and alpha selection behaves exactly
like PEFT's own injection: `target_modules` as a list (exact name or `.`-suffix) or a
regex (full match), `exclude_modules`, `layers_to_transform`, and `rank_pattern` /
`alpha_pattern` keys tried in order as regexes anchored at a `.` boundary and the end.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from engine.errors import AdapterError

CONFIG_NAME = "adapter_config.json"

# Fields of peft.LoraConfig that change the math of the forward pass (or the base weights)
# in ways a plain x·A·B·scaling kernel cannot reproduce. Refused when set to anything truthy.
_MATH_CHANGING_FLAGS = (
    "use_dora", "lora_bias", "use_qalora", "alora_invocation_tokens", "layer_replication",
    "target_parameters", "trainable_token_indices", "use_bdlora", "arrow_config",
    "kasa_config", "monteclora_config",
)
# Initialisations that rewrite the base weights; such an adapter only fits the rewritten base.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq")


@dataclass(frozen=True)
class AdapterConfig:
    """The parts of adapter_config.json that define a plain LoRA adapter."""
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str
    exclude_modules: tuple[str, ...] | str | None
    rank_pattern: tuple[tuple[str, int], ...]      # ordered: PEFT tries keys in order
    alpha_pattern: tuple[tuple[str, float], ...]
    layers_to_transform: tuple[int, ...] | None
    file: str

    @property
    def is_all_linear(self) -> bool:
        """PEFT's shorthand for every linear layer except the output head."""
        return isinstance(self.target_modules, str) and self.target_modules.lower() == "all-linear"

    def rank_of(self, module: str) -> int:
        """Rank PEFT gives `module` (a full module name)."""
        return _pattern_value(self.rank_pattern, module, self.r)

    def scaling_of(self, module: str) -> float:
        """The factor PEFT multiplies lora_B(lora_A(x)) by for `module`."""
        r = self.rank_of(module)
        alpha = _pattern_value(self.alpha_pattern, module, self.lora_alpha)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, module: str) -> bool:
        """Whether PEFT would wrap `module` (a full module name) with LoRA."""
        if self._excluded(module):
            return False
        if self.is_all_linear:
            return module != "lm_head" and not module.endswith("embed_tokens")
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module) is not None
        if module in self.target_modules:
            return True
        if not any(module.endswith(f".{t}") for t in self.target_modules):
            return False
        if self.layers_to_transform is None:
            return True
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
        return m is not None and int(m.group("idx")) in self.layers_to_transform

    def _excluded(self, module: str) -> bool:
        ex = self.exclude_modules
        if not ex:
            return False
        if isinstance(ex, str):
            return re.fullmatch(ex, module) is not None
        return module in ex or any(module.endswith(f".{e}") for e in ex)


def _pattern_value(pattern: tuple, module: str, default):
    for key, value in pattern:
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter_config(adapter_dir: str | Path, max_lora_rank: int) -> AdapterConfig:
    """Parse and check `adapter_dir/adapter_config.json`; raise AdapterError naming the
    feature and the file for anything a plain multi-LoRA kernel cannot serve."""
    path = Path(adapter_dir) / CONFIG_NAME
    file = str(path)
    if not path.is_file():
        raise AdapterError(f"adapter directory has no {CONFIG_NAME}", feature="adapter_config",
                           file=file)
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{CONFIG_NAME} is not valid JSON: {e}", feature="adapter_config",
                           file=file) from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{CONFIG_NAME} must hold a JSON object", feature="adapter_config",
                           file=file)
    _refuse_unsupported(raw, file)
    cfg = AdapterConfig(
        r=_positive_int(raw.get("r", 8), "r", file),
        lora_alpha=_number(raw.get("lora_alpha", 8), "lora_alpha", file),
        use_rslora=bool(raw.get("use_rslora", False)),
        target_modules=_targets(raw.get("target_modules"), file),
        exclude_modules=_str_or_list(raw.get("exclude_modules"), "exclude_modules", file),
        rank_pattern=_pattern(raw.get("rank_pattern"), "rank_pattern", file, _positive_int),
        alpha_pattern=_pattern(raw.get("alpha_pattern"), "alpha_pattern", file, _number),
        layers_to_transform=_layers(raw, file),
        file=file,
    )
    for name, r in (("r", cfg.r), *((f"rank_pattern[{k!r}]", v) for k, v in cfg.rank_pattern)):
        if r > max_lora_rank:
            raise AdapterError(f"{name}={r} exceeds max_lora_rank={max_lora_rank}",
                               feature="rank", file=file)
    return cfg


def _refuse_unsupported(raw: dict, file: str) -> None:
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"peft_type={peft_type!r} is not supported (only LORA)",
                           feature="peft_type", file=file)
    for flag in _MATH_CHANGING_FLAGS:
        if raw.get(flag):
            raise AdapterError(f"{flag}={raw[flag]!r} is not supported", feature=flag, file=file)
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"bias={raw['bias']!r} is not supported (only 'none')",
                           feature="bias", file=file)
    if raw.get("modules_to_save"):
        raise AdapterError(f"modules_to_save={raw['modules_to_save']!r} is not supported "
                           "(fully trained copies of base modules)", feature="modules_to_save",
                           file=file)
    if raw.get("fan_in_fan_out"):
        raise AdapterError("fan_in_fan_out=true is not supported (Conv1D-style weights)",
                           feature="fan_in_fan_out", file=file)
    init = raw.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise AdapterError(f"init_lora_weights={init!r} rewrites the base weights; convert the "
                           "adapter to plain LoRA first", feature="init_lora_weights", file=file)


def _positive_int(v, name: str, file: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise AdapterError(f"{name}={v!r}: must be a positive integer", feature=name.split("[")[0],
                           file=file)
    return v


def _number(v, name: str, file: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise AdapterError(f"{name}={v!r}: must be a finite number", feature=name.split("[")[0],
                           file=file)
    return float(v)


def _str_or_list(v, name: str, file: str):
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return tuple(v)
    raise AdapterError(f"{name}={v!r}: must be a string or a list of strings", feature=name,
                       file=file)


def _targets(v, file: str):
    if v is None or v == [] or v == "":
        raise AdapterError("target_modules is empty", feature="target_modules", file=file)
    out = _str_or_list(v, "target_modules", file)
    if isinstance(out, str) and out.lower() != "all-linear":
        _compile(out, "target_modules", file)
    return out


def _pattern(v, name: str, file: str, check) -> tuple:
    if not v:
        return ()
    if not isinstance(v, dict):
        raise AdapterError(f"{name} must be a JSON object", feature=name, file=file)
    for key in v:
        _compile(key, name, file)
    return tuple((k, check(val, f"{name}[{k!r}]", file)) for k, val in v.items())


def _compile(pattern: str, name: str, file: str) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise AdapterError(f"{name}: {pattern!r} is not a valid regex ({e})", feature=name,
                           file=file) from None


def _layers(raw: dict, file: str) -> tuple[int, ...] | None:
    layers = raw.get("layers_to_transform")
    if layers is None or layers == []:
        return None
    pattern = raw.get("layers_pattern")
    if pattern not in (None, "", [], "layers", ["layers"]):
        raise AdapterError(f"layers_pattern={pattern!r} is not supported (only 'layers')",
                           feature="layers_pattern", file=file)
    if isinstance(layers, int) and not isinstance(layers, bool):
        return (layers,)
    if isinstance(layers, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                        for i in layers):
        return tuple(layers)
    raise AdapterError(f"layers_to_transform={layers!r}: must be an int or a list of ints",
                       feature="layers_to_transform", file=file)
