"""One projection group's LoRA (y += x·Aᵀ·Bᵀ per token's adapter) as each implementation
runs it, on one buffer set of benchmarks/bench_peers.py:

    set: x [T, K], y [T, N], a [L, S, R, K], b [L, N, R] (scaling folded in: 1.0 for the
         peers), slots [T] (token -> adapter), offsets (S + 1 output bounds), ranks [L],
         meta (ours, built once per step)

Each `*_call` lays the weights out as that implementation's pool holds them and builds
its per-step metadata as its server does once per step (outside the timed call, as ours
is); the closure it returns is what one layer's forward launches for the group.
"""
from __future__ import annotations

from typing import Callable

import torch

from benchmarks.peer_shims import LoRABatchInfo

_VLLM = "vllm.lora.ops.triton_ops."
_SGLANG = "sglang.kernels.ops.lora.dense."

# SGLang's server default (--max-lora-chunk-size 16; it allows 16/32/64/128) and the
# floor of its chunk rule (sglang/srt/lora/backend/chunked_backend.py MIN_CHUNK_SIZE).
SGLANG_DEFAULT_CHUNK = 16
_SGLANG_MIN_CHUNK = 16


def ours_hints(slots: torch.Tensor, device) -> tuple[bool, bool]:
    """(uniform, spread) as the engine gives them to add_lora for this step (one request
    per adapter run: the hints depend only on rows and distinct adapters)."""
    from loramux_engine.lora.batch import spread_over_adapters
    from loramux_kernels.lora.launch import mixed_min_rows
    T = slots.shape[0]
    ids, counts = torch.unique(slots.cpu(), return_counts=True)
    uniform = ids.numel() == 1
    spread = spread_over_adapters(zip(ids.tolist(), counts.tolist()),
                                  mixed_min_rows(device, T))
    return uniform, spread


def ours_path(s: dict) -> str:
    """The path kernels/lora/plan.py chooses for this set (tokens, mixed or tiles)."""
    from loramux_kernels.lora import plan
    uniform, spread = ours_hints(s["slots"], s["x"].device)
    o = s["offsets"]
    widest = max(hi - lo for lo, hi in zip(o, o[1:]))
    return plan.choose(s["x"].device, s["x"].shape[0], uniform, spread, len(o) - 1,
                       s["x"].shape[1], widest, s["a"].shape[2])


def ours_call(s: dict) -> Callable[[], None]:
    """loramux_kernels.lora.launch.add_lora on the planner's path, with the engine's hints."""
    from loramux_kernels.lora.launch import add_lora
    uniform, spread = ours_hints(s["slots"], s["x"].device)

    def run():
        add_lora(s["y"], s["x"], s["a"], s["b"], s["slots"], s["offsets"], s["ranks"],
                 s["meta"], uniform=uniform, spread=spread)
    return run


def vllm_call(mods: dict, s: dict) -> Callable[[], None]:
    """vLLM's PunicaWrapperGPU.add_lora_linear: a float32 buffer [S, T, R], lora_shrink
    into it (it zeroes it), lora_expand adding into y. Weights per slice as its
    lora_a_stacked (L, 1, R, K) and lora_b_stacked (L, 1, n_s, R); max_loras L; the
    metadata of LoRAKernelMeta.prepare_tensors with its default launch grid
    (specialize_active_lora off: max_loras + 1 adapter programs)."""
    shrink = mods[_VLLM + "lora_shrink_op"].lora_shrink
    expand = mods[_VLLM + "lora_expand_op"].lora_expand
    meta_cls = mods[_VLLM + "lora_kernel_metadata"].LoRAKernelMeta
    # Its pointer tables are kept by the weights' addresses, made once for a server whose
    # pool never moves; here each case allocates new weights, which may land at the
    # addresses of an earlier case's with other strides: start the tables afresh.
    utils = mods[_VLLM + "utils"]
    utils._LORA_A_PTR_DICT.clear()
    utils._LORA_B_PTR_DICT.clear()
    x, y, a, b, o = s["x"], s["y"], s["a"], s["b"], s["offsets"]
    L, S, R, _ = a.shape
    T = x.shape[0]
    a_stacked = tuple(a[:, i:i + 1].contiguous() for i in range(S))
    b_stacked = tuple(b[:, lo:hi].unsqueeze(1).contiguous() for lo, hi in zip(o, o[1:]))
    meta = meta_cls.make(L, T, device=x.device, captured_lora_counts=[L + 1])
    meta.prepare_tensors(s["slots"].to(torch.int32))
    args = meta.meta_args(T, False)

    def run():
        buffer = torch.empty((S, T, R), dtype=torch.float32, device=x.device)
        shrink(x, a_stacked, buffer, *args, 1.0)
        expand(buffer, b_stacked, y, *args, offset_start=0, add_inputs=True)
    return run


def sglang_chunk(tokens: int, max_chunk: int = SGLANG_DEFAULT_CHUNK) -> int:
    """The chunk (rows per segment) SGLang's chunked backend takes for a batch of
    `tokens` under --max-lora-chunk-size `max_chunk` (ChunkedSgmvLoRABackend
    ._determine_chunk_size_for_tokens)."""
    if max_chunk <= _SGLANG_MIN_CHUNK:
        return _SGLANG_MIN_CHUNK
    return min(max_chunk, 128 if tokens >= 256 else 32 if tokens >= 64 else 16)


def sglang_batch_info(slots: torch.Tensor, L: int, R: int, chunk: int) -> LoRABatchInfo:
    """The batch info SGLang's chunked backend prepares for a step (prepare_lora_batch):
    tokens stably sorted by adapter (`permutation`), each adapter's run cut into segments
    of at most `chunk` rows; exact segment count (its eager grid; under a CUDA graph it
    pads the grid with empty segments, which return at once)."""
    dev = slots.device
    order = torch.argsort(slots.cpu().long(), stable=True)
    ids, counts = torch.unique_consecutive(slots.cpu().long()[order], return_counts=True)
    weights, lens = [], []
    for w, n in zip(ids.tolist(), counts.tolist()):
        k = -(-n // chunk)
        weights += [w] * k
        lens += [chunk] * (k - 1) + [n - (k - 1) * chunk]
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(lens), 0)
    return LoRABatchInfo(
        use_cuda_graph=False, bs=slots.shape[0], num_segments=len(lens),
        seg_indptr=indptr.to(dev), weight_indices=torch.tensor(weights, dtype=torch.int32,
                                                              device=dev),
        lora_ranks=torch.full((L,), R, dtype=torch.int32, device=dev),
        scalings=torch.ones(L, dtype=torch.float32, device=dev), max_len=chunk,
        seg_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        permutation=order.to(device=dev, dtype=torch.int32))


def sglang_call(mods: dict, s: dict, chunk: int) -> Callable[[], None]:
    """SGLang's chunked backend (run_qkv_lora / run_gate_up_lora / run_lora_*_sgemm):
    chunked_sgmv_lora_shrink_forward into a [T, S·R] buffer of x's dtype, then
    chunked_sgmv_lora_expand_forward adding into y (its base output) with the layer's
    slice offsets, also on the host as its layers pass them. Weights as its pool holds
    them: A (L, S·R, K), B (L, N, R); scalings 1 (ours folds the scaling into B)."""
    shrink = mods[_SGLANG + "chunked_sgmv_shrink"].chunked_sgmv_lora_shrink_forward
    expand = mods[_SGLANG + "chunked_sgmv_expand"].chunked_sgmv_lora_expand_forward
    x, y, a, b, o = s["x"], s["y"], s["a"], s["b"], s["offsets"]
    L, S, R, K = a.shape
    a_w = a.reshape(L, S * R, K)
    info = sglang_batch_info(s["slots"], L, R, chunk)
    offsets_cpu = torch.tensor(o, dtype=torch.int32)
    offsets = offsets_cpu.to(x.device)
    widest = max(hi - lo for lo, hi in zip(o, o[1:]))

    def run():
        h = shrink(x, a_w, info, S)
        expand(h, b, info, offsets, widest, y, offsets_cpu)
    return run
