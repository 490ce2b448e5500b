"""Loading the peers' kernel files (benchmarks/peer_sources.py) without their packages.

Their files import a few helpers from their own packages; `load` runs each file as the
module it is (its own name, its own path, so a file that reads data beside itself finds
it) with stand-ins for those helpers, then takes the stand-ins and the modules out of
sys.modules again, so nothing named vllm or sglang stays importable. What each stand-in
replaces, and why the kernels run as they would in the peer's server on the same GPU:

vLLM 0.33.0 (vllm/lora/ops/triton_ops/*):
- vllm.triton_utils: `triton`, `tl`: the same modules (theirs re-exports them when triton
  is installed).
- vllm.envs: the four variables read, at their defaults: VLLM_TUNED_CONFIG_FOLDER None
  (no tuned file: `get_lora_op_configs` returns its built-in defaults, as a server
  started without one does), VLLM_BATCH_INVARIANT False, VLLM_LORA_ENABLE_DUAL_STREAM
  False (so no programmatic dependent launch), VLLM_LORA_DISABLE_PDL False.
- vllm.platforms.current_platform: is_cuda / has_device_capability / is_device_capability
  from torch.cuda, as theirs answers on an NVIDIA GPU (on an H100/H200, capability 90:
  the expand of a float32 buffer takes NUM_STAGES 1 there, as in vLLM).
- vllm.utils.torch_utils: `direct_register_custom_op` does nothing, so `torch.ops.vllm`
  has no op and the modules take their own fallback, the plain Python function the op
  would wrap (the same launches; the op matters only to torch.compile);
  `async_tensor_h2d`: a tensor of the values on the device (theirs stages through pinned
  memory; the pointer tables it builds are made once, before timing).
- vllm.utils.math_utils.next_power_of_2 and vllm.logger.init_logger: the same arithmetic,
  a plain logger with their `*_once` methods.

SGLang 0.5.23 (sglang/kernels/ops/lora/dense/*):
- sglang.srt.utils.cached_triton_kernel: returns the kernel as it is (Triton's own cache,
  their choice off CUDA). On CUDA theirs keeps each compiled kernel by a key to skip
  Triton's argument dispatch on the host, which a CUDA graph replay never runs.
- sglang.srt.utils.get_device_name: torch.cuda.get_device_name, as theirs on CUDA, so the
  tuned launch configurations shipped beside the kernels (csgmv_configs/) are found.
- sglang.srt.environ.envs: SGLANG_ENABLE_LORA_CSGMV_SPLIT_K and
  SGLANG_ENABLE_DETERMINISTIC_INFERENCE at their defaults (False).
- sglang.srt.lora.utils.LoRABatchInfo: a dataclass with the fields the kernels read,
  filled as their chunked backend fills it (benchmarks/peer_calls.py).
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from benchmarks.peer_sources import PeerSpec


class _Env:
    """One variable of theirs: `.get()` (SGLang's EnvBool) returns its default."""

    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value

    def is_set(self) -> bool:
        return False


class _Platform:
    """vLLM's current_platform, the three questions its LoRA ops ask."""

    @staticmethod
    def is_cuda() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    def _capability() -> int:
        if not torch.cuda.is_available():
            return -1
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor

    def has_device_capability(self, capability: int) -> bool:
        return self._capability() >= capability

    def is_device_capability(self, capability: int) -> bool:
        return self._capability() == capability


class _Logger(logging.LoggerAdapter):
    """vLLM's logger: its `*_once` methods say each message once."""
    said: set = set()

    def _once(self, level: int, msg, args) -> None:
        if (level, msg) not in self.said:
            self.said.add((level, msg))
            self.log(level, msg, *args)

    def warning_once(self, msg, *args, **kwargs):
        self._once(logging.WARNING, msg, args)

    def info_once(self, msg, *args, **kwargs):
        self._once(logging.INFO, msg, args)

    def debug_once(self, msg, *args, **kwargs):
        self._once(logging.DEBUG, msg, args)


def _init_logger(name: str) -> _Logger:
    return _Logger(logging.getLogger(f"peers.{name}"), {})


def _async_tensor_h2d(data, device=None, dtype=None, out=None, pin_memory=None):
    return torch.tensor(data, dtype=dtype, device=device)


def _next_power_of_2(n: int) -> int:
    return 1 if n < 1 else 1 << (n - 1).bit_length()


@dataclass
class LoRABatchInfo:
    """SGLang's LoRABatchInfo: the fields its chunked SGMV kernels read."""
    use_cuda_graph: bool
    bs: int
    num_segments: int
    seg_indptr: torch.Tensor
    weight_indices: torch.Tensor
    lora_ranks: torch.Tensor
    scalings: torch.Tensor
    max_len: Optional[int]
    seg_lens: Optional[torch.Tensor]
    permutation: Optional[torch.Tensor] = None


def _vllm_shims() -> dict[str, dict]:
    import triton
    import triton.language as tl
    return {
        "vllm.envs": dict(VLLM_TUNED_CONFIG_FOLDER=None, VLLM_BATCH_INVARIANT=False,
                          VLLM_LORA_ENABLE_DUAL_STREAM=False, VLLM_LORA_DISABLE_PDL=False),
        "vllm.logger": dict(init_logger=_init_logger),
        "vllm.platforms": dict(current_platform=_Platform()),
        "vllm.triton_utils": dict(triton=triton, tl=tl),
        "vllm.utils.math_utils": dict(next_power_of_2=_next_power_of_2),
        "vllm.utils.torch_utils": dict(direct_register_custom_op=lambda **kw: None,
                                       async_tensor_h2d=_async_tensor_h2d),
    }


def _device_name(device_id: int = 0) -> str:
    return torch.cuda.get_device_name(device_id) if torch.cuda.is_available() else "cpu"


def _sglang_shims() -> dict[str, dict]:
    return {
        "sglang.srt.environ": dict(envs=types.SimpleNamespace(
            SGLANG_ENABLE_LORA_CSGMV_SPLIT_K=_Env(False),
            SGLANG_ENABLE_DETERMINISTIC_INFERENCE=_Env(False))),
        "sglang.srt.lora.utils": dict(LoRABatchInfo=LoRABatchInfo),
        "sglang.srt.utils": dict(cached_triton_kernel=lambda key_fn=None: (lambda fn: fn),
                                 get_device_name=_device_name),
    }


SHIMS = {"vllm": _vllm_shims, "sglang": _sglang_shims}


def load(spec: PeerSpec, folder: Path) -> dict[str, types.ModuleType]:
    """Run `spec`'s modules from the extracted files under `folder` with the peer's
    stand-ins; returns them by module name. Raises what a module raises on import."""
    shims = SHIMS[spec.name]()
    with _isolated(spec.name):
        for name, attrs in shims.items():
            _module(name).__dict__.update(attrs)
        loaded = {}
        for name in spec.modules:
            path = folder / (name.replace(".", "/") + ".py")
            parent = name.rpartition(".")[0]
            _module(parent).__path__ = [str(path.parent)]
            module_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
            loaded[name] = module
        return loaded


def _module(name: str) -> types.ModuleType:
    """sys.modules[name], made (with its parents, as packages) where absent."""
    if name in sys.modules:
        return sys.modules[name]
    module = types.ModuleType(name)
    module.__path__ = []
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(_module(parent), child, module)
    return module


@contextlib.contextmanager
def _isolated(top: str):
    """sys.modules entries of package `top` as they were before the block, after it."""
    def ours():
        return {k: v for k, v in sys.modules.items() if k == top or k.startswith(top + ".")}
    saved = ours()
    for k in saved:
        del sys.modules[k]
    try:
        yield
    finally:
        for k in ours():
            del sys.modules[k]
        sys.modules.update(saved)
