"""Text <-> token ids for one model directory, on the `tokenizers` library alone.

Only tokenizer.json is read for the vocabulary (never a slow or pickled tokenizer);
tokenizer_config.json, generation_config.json and config.json supply the special-token
facts. No torch here: the gateway tokenizes and detokenizes without it.
"""
from __future__ import annotations

import json
from pathlib import Path

from loramux_core.errors import ModelLoadError


def _read_json(path: Path) -> dict:
    """The JSON object in `path`, {} if the file is absent; a malformed file is an error."""
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path.name}: cannot read JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ModelLoadError(f"{path.name}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _token_content(value) -> str | None:
    """tokenizer_config.json writes a special token as "text" or {"content": "text", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value, where: str) -> tuple[int, ...] | None:
    """An eos_token_id field (int or list of ints) as a tuple; None when unset."""
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelLoadError(f"{where}: eos_token_id={value!r} must be an id or a list of ids")
    return tuple(values)


class Tokenizer:
    """A model's tokenizer: encode, decode and the special-token ids the engine needs."""

    def __init__(self, backend, *, bos_token_id: int | None, eos_token_ids: tuple[int, ...]):
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self._special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        """Load the tokenizer of a Hugging Face model directory.

        Raises ModelLoadError when tokenizer.json is missing or unreadable."""
        from tokenizers import Tokenizer as Backend

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(
                f"{model_dir}: no tokenizer.json (only fast tokenizers are supported; "
                "slow or pickled tokenizers are never loaded)")
        try:
            backend = Backend.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ModelLoadError(f"{path.name}: cannot load: {exc}") from exc
        # Some tokenizer.json files carry truncation/padding settings from training; a
        # prompt must never be cut or padded silently (length limits are checked upstream).
        backend.no_truncation()
        backend.no_padding()
        tok_cfg = _read_json(model_dir / "tokenizer_config.json")
        gen_cfg = _read_json(model_dir / "generation_config.json")
        model_cfg = _read_json(model_dir / "config.json")
        return cls(backend,
                   bos_token_id=_bos_id(backend, tok_cfg, gen_cfg, model_cfg),
                   eos_token_ids=_eos_ids(backend, tok_cfg, gen_cfg, model_cfg))

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, tokenizer.json's post-processor
        adds BOS/EOS. tokenizer_config.json's add_bos_token/add_eos_token are not read:
        transformers (>= 5) ignores them too when tokenizer.json exists, and it is our
        oracle for token-for-token parity."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Bytes of an incomplete UTF-8 sequence decode to U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (e.g. 'Ġworld'), None if out of range."""
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        """True for added tokens marked special (BOS, EOS, pad, chat markers...)."""
        return token_id in self._special_ids


def _bos_id(backend, tok_cfg: dict, gen_cfg: dict, model_cfg: dict) -> int | None:
    content = _token_content(tok_cfg.get("bos_token"))
    if content is not None and backend.token_to_id(content) is not None:
        return backend.token_to_id(content)
    for cfg in (gen_cfg, model_cfg):
        if isinstance(cfg.get("bos_token_id"), int):
            return cfg["bos_token_id"]
    return None


def _eos_ids(backend, tok_cfg: dict, gen_cfg: dict, model_cfg: dict) -> tuple[int, ...]:
    """generation_config.json first (it is what HF generate stops on), then config.json,
    then the tokenizer's eos token; () if none names one."""
    for cfg, where in ((gen_cfg, "generation_config.json"), (model_cfg, "config.json")):
        ids = _id_list(cfg.get("eos_token_id"), where)
        if ids:
            return ids
    content = _token_content(tok_cfg.get("eos_token"))
    if content is not None and backend.token_to_id(content) is not None:
        return (backend.token_to_id(content),)
    return ()
