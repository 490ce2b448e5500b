from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdapterState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADAPTER_STATE_UNSPECIFIED: _ClassVar[AdapterState]
    ADAPTER_STATE_REGISTERED: _ClassVar[AdapterState]
    ADAPTER_STATE_LOADED: _ClassVar[AdapterState]
    ADAPTER_STATE_UNLOADING: _ClassVar[AdapterState]

class Residency(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESIDENCY_UNSPECIFIED: _ClassVar[Residency]
    RESIDENCY_DEVICE: _ClassVar[Residency]
    RESIDENCY_HOST: _ClassVar[Residency]
    RESIDENCY_DISK: _ClassVar[Residency]

class ReplicaState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_STATE_UNSPECIFIED: _ClassVar[ReplicaState]
    REPLICA_STATE_STARTING: _ClassVar[ReplicaState]
    REPLICA_STATE_WARMING_UP: _ClassVar[ReplicaState]
    REPLICA_STATE_SERVING: _ClassVar[ReplicaState]
    REPLICA_STATE_RESTARTING: _ClassVar[ReplicaState]
    REPLICA_STATE_FAILED: _ClassVar[ReplicaState]
ADAPTER_STATE_UNSPECIFIED: AdapterState
ADAPTER_STATE_REGISTERED: AdapterState
ADAPTER_STATE_LOADED: AdapterState
ADAPTER_STATE_UNLOADING: AdapterState
RESIDENCY_UNSPECIFIED: Residency
RESIDENCY_DEVICE: Residency
RESIDENCY_HOST: Residency
RESIDENCY_DISK: Residency
REPLICA_STATE_UNSPECIFIED: ReplicaState
REPLICA_STATE_STARTING: ReplicaState
REPLICA_STATE_WARMING_UP: ReplicaState
REPLICA_STATE_SERVING: ReplicaState
REPLICA_STATE_RESTARTING: ReplicaState
REPLICA_STATE_FAILED: ReplicaState

class Adapter(_message.Message):
    __slots__ = ("name", "path", "state", "residency", "pinned", "rank", "target_modules", "id", "in_flight_requests", "loads", "evictions", "slot", "replicas")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    state: AdapterState
    residency: Residency
    pinned: bool
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    id: int
    in_flight_requests: int
    loads: int
    evictions: int
    slot: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaResidency]
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., state: _Optional[_Union[AdapterState, str]] = ..., residency: _Optional[_Union[Residency, str]] = ..., pinned: _Optional[bool] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., id: _Optional[int] = ..., in_flight_requests: _Optional[int] = ..., loads: _Optional[int] = ..., evictions: _Optional[int] = ..., slot: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaResidency, _Mapping]]] = ...) -> None: ...

class ReplicaResidency(_message.Message):
    __slots__ = ("replica", "up", "placed", "residency", "slot", "id", "in_flight_requests")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    PLACED_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    replica: int
    up: bool
    placed: bool
    residency: Residency
    slot: int
    id: int
    in_flight_requests: int
    def __init__(self, replica: _Optional[int] = ..., up: _Optional[bool] = ..., placed: _Optional[bool] = ..., residency: _Optional[_Union[Residency, str]] = ..., slot: _Optional[int] = ..., id: _Optional[int] = ..., in_flight_requests: _Optional[int] = ...) -> None: ...

class RegisterAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class RegisterAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: Adapter
    def __init__(self, adapter: _Optional[_Union[Adapter, _Mapping]] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path", "pinned", "replicas")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    pinned: bool
    replicas: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., pinned: _Optional[bool] = ..., replicas: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: Adapter
    def __init__(self, adapter: _Optional[_Union[Adapter, _Mapping]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: Adapter
    def __init__(self, adapter: _Optional[_Union[Adapter, _Mapping]] = ...) -> None: ...

class UnregisterAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnregisterAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PinAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class PinAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: Adapter
    def __init__(self, adapter: _Optional[_Union[Adapter, _Mapping]] = ...) -> None: ...

class UnpinAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnpinAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: Adapter
    def __init__(self, adapter: _Optional[_Union[Adapter, _Mapping]] = ...) -> None: ...

class GetAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: Adapter
    def __init__(self, adapter: _Optional[_Union[Adapter, _Mapping]] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "next_page_token")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    next_page_token: str
    def __init__(self, adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("replica", "state", "detail", "progress", "eta_s", "since_s", "instance_id", "restarts", "in_flight_requests")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ETA_S_FIELD_NUMBER: _ClassVar[int]
    SINCE_S_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    replica: int
    state: ReplicaState
    detail: str
    progress: float
    eta_s: float
    since_s: float
    instance_id: str
    restarts: int
    in_flight_requests: int
    def __init__(self, replica: _Optional[int] = ..., state: _Optional[_Union[ReplicaState, str]] = ..., detail: _Optional[str] = ..., progress: _Optional[float] = ..., eta_s: _Optional[float] = ..., since_s: _Optional[float] = ..., instance_id: _Optional[str] = ..., restarts: _Optional[int] = ..., in_flight_requests: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ...) -> None: ...

class LoadAdaptersRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[LoadAdapterRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[LoadAdapterRequest, _Mapping]]] = ...) -> None: ...

class LoadAdapterResult(_message.Message):
    __slots__ = ("code", "message", "adapter")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    adapter: Adapter
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., adapter: _Optional[_Union[Adapter, _Mapping]] = ...) -> None: ...

class LoadAdaptersResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[LoadAdapterResult]
    def __init__(self, results: _Optional[_Iterable[_Union[LoadAdapterResult, _Mapping]]] = ...) -> None: ...
