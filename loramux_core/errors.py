"""Typed errors raised by the engine and the services, and the gRPC status each maps to
(`error_code`: the number an engine message carries; the services send it on as the call's
status)."""
from __future__ import annotations

from loramux_core.v1 import engine_pb2


class LoramuxError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(LoramuxError, ValueError):
    """A request or its sampling parameters are malformed (gRPC INVALID_ARGUMENT)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) does not fit the model's context or the KV pool."""


class ModelLoadError(LoramuxError):
    """The base model directory cannot be loaded (missing file, unsupported config, pickle)."""


class AdapterError(LoramuxError):
    """An adapter directory is malformed or does not fit the base model.

    `feature` names what is wrong (e.g. "use_dora", "rank"), `file` the file it is in."""

    def __init__(self, message: str, *, feature: str = "", file: str = ""):
        where = f" ({file})" if file else ""
        super().__init__(f"{message}{where}")
        self.feature = feature
        self.file = file


class AdapterPathError(AdapterError):
    """The adapter path leaves the adapter roots or crosses a symbolic link (gRPC
    PERMISSION_DENIED). The message names the path only as given."""

    def __init__(self, message: str):
        super().__init__(message, feature="path")


class AdapterChangedError(AdapterError):
    """The adapter's files are not the version that was validated (registered) or loaded
    under this id (gRPC FAILED_PRECONDITION: load or register the name again)."""

    def __init__(self, message: str, file: str = ""):
        super().__init__(message, feature="changed_on_disk", file=file)


class AdapterNotFoundError(LoramuxError, KeyError):
    """No adapter of that name is known to the engine (gRPC NOT_FOUND)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class AdapterUnavailableError(LoramuxError):
    """The adapter exists but cannot take new requests now, e.g. it is being unloaded
    (gRPC FAILED_PRECONDITION)."""


class CapacityError(LoramuxError):
    """An admin operation would need to evict a pinned adapter, or pins would take every
    slot (gRPC FAILED_PRECONDITION / RESOURCE_EXHAUSTED)."""


class EngineDeadError(LoramuxError):
    """A tensor-parallel rank died or stopped answering. The engine cannot continue: the
    other ranks are stopped, and every later call raises this error again (gRPC
    UNAVAILABLE: the engine must be restarted)."""


def error_code(exc: BaseException) -> int:
    """The gRPC status number (engine_pb2.ErrorCode) a typed error maps to."""
    if isinstance(exc, AdapterNotFoundError):
        return engine_pb2.ERROR_CODE_NOT_FOUND
    if isinstance(exc, AdapterPathError):
        return engine_pb2.ERROR_CODE_PERMISSION_DENIED
    if isinstance(exc, AdapterChangedError):
        return engine_pb2.ERROR_CODE_FAILED_PRECONDITION
    if isinstance(exc, (InvalidRequestError, AdapterError)):
        return engine_pb2.ERROR_CODE_INVALID_ARGUMENT
    if isinstance(exc, CapacityError):
        return engine_pb2.ERROR_CODE_RESOURCE_EXHAUSTED
    if isinstance(exc, EngineDeadError):
        return engine_pb2.ERROR_CODE_UNAVAILABLE
    if isinstance(exc, (AdapterUnavailableError, LoramuxError)):
        return engine_pb2.ERROR_CODE_FAILED_PRECONDITION
    return engine_pb2.ERROR_CODE_INTERNAL
