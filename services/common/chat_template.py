"""Chat templates: a model's (or an adapter's) Jinja template rendered the way Hugging Face
renders it, in a sandbox.

Where a template comes from, first found wins: `chat_template.jinja` in the directory, then
`tokenizer_config.json`'s `chat_template` (a string, or a list of named templates of which
"default" is taken). An adapter directory with its own template overrides the base model's.

Templates are untrusted code (they come with downloaded models and adapters), so they run in
Jinja's ImmutableSandboxedEnvironment with the same few helpers transformers gives them
(`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII, loop controls) and the
same variables (`messages`, `add_generation_prompt`, `tools`, `documents`, and the special
tokens: `bos_token`, `eos_token`, ...). Rendered text is tokenized without adding special
tokens, as transformers' `apply_chat_template` does, so a template that writes BOS itself
never gets a second one."""
from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_TEMPLATE_BYTES = 1 << 20
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """A template cannot be read or compiled, or refused to render the given messages."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


def _read_bounded(path: Path) -> str | None:
    """Text of a regular file (never through a symlink; a FIFO or device is refused
    without blocking on it), None when absent; at most MAX_TEMPLATE_BYTES."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ChatTemplateError(f"{path.name}: cannot open: {err.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ChatTemplateError(f"{path.name} is not a regular file")
        data = f.read(MAX_TEMPLATE_BYTES + 1)
    return text_of(data, path.name)


def text_of(data: bytes, name: str) -> str:
    """The UTF-8 text of a template file's bytes (at most MAX_TEMPLATE_BYTES)."""
    if len(data) > MAX_TEMPLATE_BYTES:
        raise ChatTemplateError(f"{name} is larger than {MAX_TEMPLATE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ChatTemplateError(f"{name}: not UTF-8: {err}") from None


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config_template(config: dict) -> str | None:
    value = config.get("chat_template")
    if isinstance(value, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def _read_config(directory: Path) -> dict:
    return _parse_config(_read_bounded(directory / "tokenizer_config.json"))


def _parse_config(text: str | None) -> dict:
    if text is None:
        return {}
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise ChatTemplateError(f"tokenizer_config.json: {type(err).__name__}: "
                                f"{str(err)[:200]}") from None
    return config if isinstance(config, dict) else {}


def special_tokens_of(directory: str | os.PathLike, fallback: dict | None = None) -> dict:
    """The special tokens' text (bos_token, eos_token, ...) that a directory's
    tokenizer_config.json names, over `fallback`."""
    return _special_tokens(_read_config(Path(directory)), fallback)


def _special_tokens(config: dict, fallback: dict | None) -> dict:
    tokens = dict(fallback or {})
    for name in SPECIAL_TOKEN_NAMES:
        if (text := _token_text(config.get(name))) is not None:
            tokens[name] = text
    return tokens


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled template and the special tokens it may reference."""
    source: str
    special_tokens: dict = field(default_factory=dict)

    def __post_init__(self):
        try:
            compiled = _environment().from_string(self.source)
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the chat template does not compile: {err}") from None
        object.__setattr__(self, "_compiled", compiled)

    @classmethod
    def from_dir(cls, directory: str | os.PathLike,
                 special_tokens: dict | None = None) -> "ChatTemplate | None":
        """The template of a model or adapter directory, None if it has none. Special
        tokens come from its tokenizer_config.json, else from `special_tokens`."""
        directory = Path(directory)
        return cls.from_files(lambda name: _read_bounded(directory / name), special_tokens)

    @classmethod
    def from_files(cls, read: Callable[[str], str | None],
                   special_tokens: dict | None = None) -> "ChatTemplate | None":
        """As from_dir, with `read(name)` giving the text of the directory's file `name`
        (None when absent): e.g. read inside the adapter roots."""
        config = _parse_config(read("tokenizer_config.json"))
        source = read("chat_template.jinja") or _config_template(config)
        if source is None:
            return None
        return cls(source, _special_tokens(config, special_tokens))

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, **kwargs) -> str:
        """The prompt text for `messages` (dicts with role/content, as in the OpenAI API).

        With continue_final_message the last (assistant) message is left open, so the model
        continues it: the text is cut right after that message's content."""
        if continue_final_message and not messages:
            raise ChatTemplateError("continue_final_message needs at least one message")
        variables = {**self.special_tokens, **kwargs, "messages": messages,
                     "add_generation_prompt": add_generation_prompt}
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        try:
            text = self._compiled.render(**variables)
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the chat template refused the messages: {err}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as err:
            raise ChatTemplateError(f"the chat template failed on the messages: {err}") from None
        if continue_final_message:
            final = str(messages[-1].get("content", "")).rstrip()
            cut = text.rfind(final) if final else -1
            if cut < 0:
                raise ChatTemplateError("the final message does not appear in the rendered chat")
            text = text[:cut + len(final)]
        return text
