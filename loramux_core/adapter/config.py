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
from dataclasses import dataclass, field

from loramux_core.adapter.patterns import Pattern, check_key_count, dotted_suffixes
from loramux_core.errors import AdapterError

CONFIG_NAME = "adapter_config.json"
MAX_CONFIG_BYTES = 1 << 20

# Fields of peft.LoraConfig that change the math of the forward pass (or the base weights)
# in ways a plain x·A·B·scaling kernel cannot reproduce. Refused when set to anything truthy.
_MATH_CHANGING_FLAGS = (
    "lora_bias", "use_qalora", "alora_invocation_tokens", "layer_replication",
    "trainable_token_indices", "use_bdlora", "arrow_config",
    "kasa_config", "monteclora_config",
    "ensure_weight_tying",  # one LoRA shared by tied lm_head and embed_tokens
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
    use_dora: bool = False         # DoRA: a magnitude vector per wrapped module
    target_parameters: tuple[str, ...] = ()   # fused parameters (MoE experts), PEFT's names
    # Compiled forms of the fields above (RE2 patterns, suffix sets), built once.
    _match: dict = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_match", _compile_matchers(self))

    @property
    def is_all_linear(self) -> bool:
        """PEFT's shorthand for every linear layer except the output head."""
        return isinstance(self.target_modules, str) and self.target_modules.lower() == "all-linear"

    def rank_of(self, module: str) -> int:
        """Rank PEFT gives `module` (a full module name)."""
        return _pattern_value(self._match["rank"], self.rank_pattern, module, self.r)

    def scaling_of(self, module: str) -> float:
        """The factor PEFT multiplies lora_B(lora_A(x)) by for `module`."""
        r = self.rank_of(module)
        alpha = _pattern_value(self._match["alpha"], self.alpha_pattern, module,
                               self.lora_alpha)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, module: str) -> bool:
        """Whether PEFT would wrap `module` (a full module name) with LoRA."""
        if self._excluded(module):
            return False
        if self.is_all_linear:
            return module != "lm_head" and not module.endswith("embed_tokens")
        if isinstance(self.target_modules, str):
            return self._match["target"].matches(module)
        if not dotted_suffixes(module) & self._match["target"]:
            return False
        if module in self._match["target"]:
            return True
        if self.layers_to_transform is None:
            return True
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
        return m is not None and int(m.group("idx")) in self.layers_to_transform

    def targets_parameter(self, name: str) -> bool:
        """Whether PEFT would wrap parameter `name` (`{module}.{param}`, full name): an
        entry equal to it or a `.`-suffix of it (parse_adapter_config refuses
        exclude_modules and layers_to_transform beside target_parameters)."""
        return bool(dotted_suffixes(name) & frozenset(self.target_parameters))

    def _excluded(self, module: str) -> bool:
        ex = self.exclude_modules
        if not ex:
            return False
        if isinstance(ex, str):
            return self._match["exclude"].matches(module)
        return bool(dotted_suffixes(module) & self._match["exclude"])


def _compile_matchers(cfg: AdapterConfig) -> dict:
    """RE2 patterns for the string forms, suffix sets for the list forms."""
    def one(v, name):
        if v is None:
            return None
        return Pattern(v, False, name, cfg.file) if isinstance(v, str) else frozenset(v)
    target = None if cfg.is_all_linear else one(cfg.target_modules, "target_modules")
    return {"target": target, "exclude": one(cfg.exclude_modules, "exclude_modules"),
            "rank": tuple(Pattern(k, True, "rank_pattern", cfg.file) for k, _ in cfg.rank_pattern),
            "alpha": tuple(Pattern(k, True, "alpha_pattern", cfg.file)
                           for k, _ in cfg.alpha_pattern)}


def _pattern_value(compiled: tuple, pattern: tuple, module: str, default):
    """PEFT's get_pattern_key: the value of the first key matching `module`."""
    for matcher, (_, value) in zip(compiled, pattern):
        if matcher.matches(module):
            return value
    return default


def read_adapter_config(adapter_dir, max_lora_rank: int) -> AdapterConfig:
    """Parse and check `adapter_dir/adapter_config.json` (read through
    loramux_core/safe_files.py); see `parse_adapter_config`."""
    from loramux_core.safe_files import open_adapter_dir

    with open_adapter_dir(str(adapter_dir), None) as d:
        return parse_adapter_config(read_config_bytes(d).data, max_lora_rank,
                                    f"{d.shown}/{CONFIG_NAME}")


def read_config_bytes(d):
    """adapter_config.json of the open AdapterDir `d`, read once (a FileRead)."""
    if d.kind(CONFIG_NAME) is None:
        raise AdapterError(f"adapter directory has no {CONFIG_NAME}", feature="adapter_config",
                           file=f"{d.shown}/{CONFIG_NAME}")
    return d.read(CONFIG_NAME, MAX_CONFIG_BYTES)


def parse_adapter_config(data: bytes, max_lora_rank: int, file: str) -> AdapterConfig:
    """Parse and check the bytes of an adapter_config.json; raise AdapterError naming the
    feature and the file for anything a plain multi-LoRA kernel cannot serve."""
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        why = e if isinstance(e, json.JSONDecodeError) else type(e).__name__
        raise AdapterError(f"{CONFIG_NAME} is not valid JSON: {why}", feature="adapter_config",
                           file=file) from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{CONFIG_NAME} must hold a JSON object", feature="adapter_config",
                           file=file)
    _refuse_unsupported(raw, file)
    params = _str_list(raw.get("target_parameters"), "target_parameters", file)
    cfg = AdapterConfig(
        r=_positive_int(raw.get("r", 8), "r", file),
        lora_alpha=_number(raw.get("lora_alpha", 8), "lora_alpha", file),
        use_rslora=bool(raw.get("use_rslora", False)),
        target_modules=_targets(raw.get("target_modules"), file, bool(params)),
        exclude_modules=_str_or_list(raw.get("exclude_modules"), "exclude_modules", file),
        rank_pattern=_pattern(raw.get("rank_pattern"), "rank_pattern", file, _positive_int),
        alpha_pattern=_pattern(raw.get("alpha_pattern"), "alpha_pattern", file, _number),
        layers_to_transform=_layers(raw, file),
        file=file,
        use_dora=_flag(raw.get("use_dora", False), "use_dora", file),
        target_parameters=params,
    )
    if cfg.use_dora and params:
        raise AdapterError("use_dora=true with target_parameters: PEFT has no DoRA on "
                           "parameters", feature="use_dora", file=file)
    for name in ("layers_to_transform", "exclude_modules"):
        if params and raw.get(name):
            raise AdapterError(f"{name} with target_parameters is not supported",
                               feature=name, file=file)
    for name, r in (("r", cfg.r), *((f"rank_pattern[{k!r}]", v) for k, v in cfg.rank_pattern)):
        if r > max_lora_rank:
            raise AdapterError(f"{name}={r} exceeds max_lora_rank={max_lora_rank} (the "
                               "engine's and control plane's --max-lora-rank)",
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


def _flag(v, name: str, file: str) -> bool:
    if not isinstance(v, bool):
        raise AdapterError(f"{name}={v!r}: must be true or false", feature=name, file=file)
    return v


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


def _targets(v, file: str, has_parameters: bool):
    if v is None or v == [] or v == "":
        if has_parameters:
            return ()
        raise AdapterError("target_modules is empty", feature="target_modules", file=file)
    return _str_or_list(v, "target_modules", file)


def _str_list(v, name: str, file: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, list) and all(isinstance(x, str) and x for x in v):
        return tuple(v)
    raise AdapterError(f"{name}={v!r}: must be a list of names", feature=name, file=file)


def _pattern(v, name: str, file: str, check) -> tuple:
    if not v:
        return ()
    if not isinstance(v, dict):
        raise AdapterError(f"{name} must be a JSON object", feature=name, file=file)
    check_key_count(len(v), name, file)
    return tuple((k, check(val, f"{name}[{k!r}]", file)) for k, val in v.items())


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
