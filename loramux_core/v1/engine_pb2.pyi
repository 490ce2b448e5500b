from loramux.v1 import adapter_admin_pb2 as _adapter_admin_pb2
from loramux.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdapterCommandKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADAPTER_COMMAND_KIND_UNSPECIFIED: _ClassVar[AdapterCommandKind]
    ADAPTER_COMMAND_KIND_LOAD: _ClassVar[AdapterCommandKind]
    ADAPTER_COMMAND_KIND_UNLOAD: _ClassVar[AdapterCommandKind]
    ADAPTER_COMMAND_KIND_PIN: _ClassVar[AdapterCommandKind]
    ADAPTER_COMMAND_KIND_UNPIN: _ClassVar[AdapterCommandKind]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_ARGUMENT: _ClassVar[ErrorCode]
    ERROR_CODE_NOT_FOUND: _ClassVar[ErrorCode]
    ERROR_CODE_PERMISSION_DENIED: _ClassVar[ErrorCode]
    ERROR_CODE_RESOURCE_EXHAUSTED: _ClassVar[ErrorCode]
    ERROR_CODE_FAILED_PRECONDITION: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
    ERROR_CODE_UNAVAILABLE: _ClassVar[ErrorCode]

class EnginePhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_PHASE_UNSPECIFIED: _ClassVar[EnginePhase]
    ENGINE_PHASE_LOADING: _ClassVar[EnginePhase]
    ENGINE_PHASE_WARMING_UP: _ClassVar[EnginePhase]
    ENGINE_PHASE_SERVING: _ClassVar[EnginePhase]
ADAPTER_COMMAND_KIND_UNSPECIFIED: AdapterCommandKind
ADAPTER_COMMAND_KIND_LOAD: AdapterCommandKind
ADAPTER_COMMAND_KIND_UNLOAD: AdapterCommandKind
ADAPTER_COMMAND_KIND_PIN: AdapterCommandKind
ADAPTER_COMMAND_KIND_UNPIN: AdapterCommandKind
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_INVALID_ARGUMENT: ErrorCode
ERROR_CODE_NOT_FOUND: ErrorCode
ERROR_CODE_PERMISSION_DENIED: ErrorCode
ERROR_CODE_RESOURCE_EXHAUSTED: ErrorCode
ERROR_CODE_FAILED_PRECONDITION: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode
ERROR_CODE_UNAVAILABLE: ErrorCode
ENGINE_PHASE_UNSPECIFIED: EnginePhase
ENGINE_PHASE_LOADING: EnginePhase
ENGINE_PHASE_WARMING_UP: EnginePhase
ENGINE_PHASE_SERVING: EnginePhase

class EngineGenerate(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "adapter", "sampling", "generated_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    adapter: str
    sampling: _generate_pb2.SamplingParams
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., adapter: _Optional[str] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., generated_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EngineAbort(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AdapterCommand(_message.Message):
    __slots__ = ("command_id", "kind", "name", "path", "pinned", "version")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    kind: AdapterCommandKind
    name: str
    path: str
    pinned: bool
    version: str
    def __init__(self, command_id: _Optional[str] = ..., kind: _Optional[_Union[AdapterCommandKind, str]] = ..., name: _Optional[str] = ..., path: _Optional[str] = ..., pinned: _Optional[bool] = ..., version: _Optional[str] = ...) -> None: ...

class EngineInput(_message.Message):
    __slots__ = ("generate", "abort", "adapter_command")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_COMMAND_FIELD_NUMBER: _ClassVar[int]
    generate: EngineGenerate
    abort: EngineAbort
    adapter_command: AdapterCommand
    def __init__(self, generate: _Optional[_Union[EngineGenerate, _Mapping]] = ..., abort: _Optional[_Union[EngineAbort, _Mapping]] = ..., adapter_command: _Optional[_Union[AdapterCommand, _Mapping]] = ...) -> None: ...

class RequestDelta(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "text", "finished", "finish_reason", "prompt_tokens", "cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    text: str
    finished: bool
    finish_reason: _generate_pb2.FinishReason
    prompt_tokens: int
    cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("request_id", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: ErrorCode
    message: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ...) -> None: ...

class StepBatch(_message.Message):
    __slots__ = ("step", "deltas", "errors")
    STEP_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    step: int
    deltas: _containers.RepeatedCompositeFieldContainer[RequestDelta]
    errors: _containers.RepeatedCompositeFieldContainer[RequestError]
    def __init__(self, step: _Optional[int] = ..., deltas: _Optional[_Iterable[_Union[RequestDelta, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[RequestError, _Mapping]]] = ...) -> None: ...

class AdapterAck(_message.Message):
    __slots__ = ("command_id", "ok", "code", "message", "adapter_id", "version")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    ok: bool
    code: ErrorCode
    message: str
    adapter_id: int
    version: str
    def __init__(self, command_id: _Optional[str] = ..., ok: _Optional[bool] = ..., code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ..., adapter_id: _Optional[int] = ..., version: _Optional[str] = ...) -> None: ...

class AdapterStatus(_message.Message):
    __slots__ = ("name", "id", "path", "residency", "slot", "pinned", "unloading", "in_flight_requests", "loads", "evictions", "rank", "running_requests", "waiting_requests")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    UNLOADING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    id: int
    path: str
    residency: _adapter_admin_pb2.Residency
    slot: int
    pinned: bool
    unloading: bool
    in_flight_requests: int
    loads: int
    evictions: int
    rank: int
    running_requests: int
    waiting_requests: int
    def __init__(self, name: _Optional[str] = ..., id: _Optional[int] = ..., path: _Optional[str] = ..., residency: _Optional[_Union[_adapter_admin_pb2.Residency, str]] = ..., slot: _Optional[int] = ..., pinned: _Optional[bool] = ..., unloading: _Optional[bool] = ..., in_flight_requests: _Optional[int] = ..., loads: _Optional[int] = ..., evictions: _Optional[int] = ..., rank: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ...) -> None: ...

class HistogramSnapshot(_message.Message):
    __slots__ = ("name", "bounds", "bucket_counts", "sum")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BOUNDS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_COUNTS_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    name: str
    bounds: _containers.RepeatedScalarFieldContainer[float]
    bucket_counts: _containers.RepeatedScalarFieldContainer[int]
    sum: float
    def __init__(self, name: _Optional[str] = ..., bounds: _Optional[_Iterable[float]] = ..., bucket_counts: _Optional[_Iterable[int]] = ..., sum: _Optional[float] = ...) -> None: ...

class EngineCounters(_message.Message):
    __slots__ = ("kv_blocks_total", "kv_blocks_free", "max_loras", "slots_used", "host_copies", "pending_evictions", "base_cached_token_hits", "adapter_slot_loads", "adapter_slot_evictions", "adapter_disk_reads", "adapter_host_evictions", "host_reserve_target", "host_reserve_ready", "host_reserve_taken")
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    HOST_COPIES_FIELD_NUMBER: _ClassVar[int]
    PENDING_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BASE_CACHED_TOKEN_HITS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SLOT_LOADS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SLOT_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_DISK_READS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_HOST_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    HOST_RESERVE_TARGET_FIELD_NUMBER: _ClassVar[int]
    HOST_RESERVE_READY_FIELD_NUMBER: _ClassVar[int]
    HOST_RESERVE_TAKEN_FIELD_NUMBER: _ClassVar[int]
    kv_blocks_total: int
    kv_blocks_free: int
    max_loras: int
    slots_used: int
    host_copies: int
    pending_evictions: int
    base_cached_token_hits: int
    adapter_slot_loads: int
    adapter_slot_evictions: int
    adapter_disk_reads: int
    adapter_host_evictions: int
    host_reserve_target: int
    host_reserve_ready: int
    host_reserve_taken: int
    def __init__(self, kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., max_loras: _Optional[int] = ..., slots_used: _Optional[int] = ..., host_copies: _Optional[int] = ..., pending_evictions: _Optional[int] = ..., base_cached_token_hits: _Optional[int] = ..., adapter_slot_loads: _Optional[int] = ..., adapter_slot_evictions: _Optional[int] = ..., adapter_disk_reads: _Optional[int] = ..., adapter_host_evictions: _Optional[int] = ..., host_reserve_target: _Optional[int] = ..., host_reserve_ready: _Optional[int] = ..., host_reserve_taken: _Optional[int] = ...) -> None: ...

class EngineEvent(_message.Message):
    __slots__ = ("adapters", "running_requests", "waiting_requests", "histograms", "counters")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAMS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterStatus]
    running_requests: int
    waiting_requests: int
    histograms: _containers.RepeatedCompositeFieldContainer[HistogramSnapshot]
    counters: EngineCounters
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterStatus, _Mapping]]] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., histograms: _Optional[_Iterable[_Union[HistogramSnapshot, _Mapping]]] = ..., counters: _Optional[_Union[EngineCounters, _Mapping]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("instance_id", "seq", "max_model_len", "vocab_size", "in_flight_requests", "unix_time", "phase", "phase_detail", "phase_progress", "phase_eta_s")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PHASE_DETAIL_FIELD_NUMBER: _ClassVar[int]
    PHASE_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PHASE_ETA_S_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    seq: int
    max_model_len: int
    vocab_size: int
    in_flight_requests: int
    unix_time: float
    phase: EnginePhase
    phase_detail: str
    phase_progress: float
    phase_eta_s: float
    def __init__(self, instance_id: _Optional[str] = ..., seq: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., in_flight_requests: _Optional[int] = ..., unix_time: _Optional[float] = ..., phase: _Optional[_Union[EnginePhase, str]] = ..., phase_detail: _Optional[str] = ..., phase_progress: _Optional[float] = ..., phase_eta_s: _Optional[float] = ...) -> None: ...

class EngineOutput(_message.Message):
    __slots__ = ("instance_id", "step_batch", "heartbeat", "adapter_ack", "event")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_BATCH_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ACK_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    step_batch: StepBatch
    heartbeat: Heartbeat
    adapter_ack: AdapterAck
    event: EngineEvent
    def __init__(self, instance_id: _Optional[str] = ..., step_batch: _Optional[_Union[StepBatch, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., adapter_ack: _Optional[_Union[AdapterAck, _Mapping]] = ..., event: _Optional[_Union[EngineEvent, _Mapping]] = ...) -> None: ...

class AdapterTableEntry(_message.Message):
    __slots__ = ("name", "state", "pinned", "id", "path", "replicas")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: _adapter_admin_pb2.AdapterState
    pinned: bool
    id: int
    path: str
    replicas: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., state: _Optional[_Union[_adapter_admin_pb2.AdapterState, str]] = ..., pinned: _Optional[bool] = ..., id: _Optional[int] = ..., path: _Optional[str] = ..., replicas: _Optional[_Iterable[int]] = ...) -> None: ...

class AdapterTable(_message.Message):
    __slots__ = ("version", "entries", "replayed")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    version: int
    entries: _containers.RepeatedCompositeFieldContainer[AdapterTableEntry]
    replayed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[AdapterTableEntry, _Mapping]]] = ..., replayed: _Optional[_Iterable[str]] = ...) -> None: ...
