"""A request's output constraint (JSON schema, any JSON object, regex, choice, grammar) as
every process sees it: the gateway checks its form, the engine compiles it with the
grammar library and masks the tokens it forbids (docs/SERVING.md, Structured outputs)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from loramux.v1 import generate_pb2

from loramux_core.errors import InvalidRequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# bounds on what one request may ask the compiler to read; a larger text is refused before
# it reaches the library
MAX_SPEC_BYTES = 256 * 1024
MAX_CHOICES = 4096
# JSON is written as Python's json.dumps writes it (", " and ": ", no other whitespace):
# a model under a schema cannot fill the output with whitespace until max_tokens, a known
# failure of flexible-whitespace JSON grammars, and the form is the one models see most
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """`kind` is one of KINDS; `spec` the constraint's text: the schema's JSON, the regex,
    the grammar, or for a choice the JSON list of its strings ("" for json_object). The
    pair is the key compiled grammars are cached by."""
    kind: str
    spec: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.spec

    @property
    def choices(self) -> list[str]:
        assert self.kind == "choice"
        return json.loads(self.spec)

    @classmethod
    def choice_of(cls, choices) -> "StructuredOutput":
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    def validate(self) -> None:
        """Its form only (the library judges the content when it compiles)."""
        field = f"sampling.structured.{self.kind}"
        if self.kind not in KINDS:
            raise InvalidRequestError(f"sampling.structured: unknown kind {self.kind!r}")
        if len(self.spec.encode()) > MAX_SPEC_BYTES:
            raise InvalidRequestError(f"{field}: longer than {MAX_SPEC_BYTES} bytes")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except (ValueError, RecursionError) as e:  # nested past the parser's depth
                raise InvalidRequestError(f"{field}: not JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError(f"{field}: a schema is a JSON object")
        elif self.kind in ("regex", "grammar") and not self.spec:
            raise InvalidRequestError(f"{field}: empty")
        elif self.kind == "choice":
            choices = json.loads(self.spec)
            if not choices or len(choices) > MAX_CHOICES:
                raise InvalidRequestError(f"{field}: 1 to {MAX_CHOICES} strings")
            if not all(isinstance(c, str) and c for c in choices):
                raise InvalidRequestError(f"{field}: every choice is a non-empty string")


def structured_from_proto(pb: generate_pb2.StructuredOutput) -> StructuredOutput | None:
    kind = pb.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "choice":
        return StructuredOutput.choice_of(pb.choice.choices)
    return StructuredOutput(kind, getattr(pb, kind))


def structured_to_proto(s: StructuredOutput | None) -> generate_pb2.StructuredOutput:
    pb = generate_pb2.StructuredOutput()
    if s is None:
        return pb
    if s.kind == "json_object":
        pb.json_object = True
    elif s.kind == "choice":
        pb.choice.choices.extend(s.choices)
    else:
        setattr(pb, s.kind, s.spec)
    return pb
