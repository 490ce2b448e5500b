"""Which LoRA kernels run a call: one table, read by one function.

    choose(device, tokens, uniform, spread, slices, k, widest) -> TOKENS | MIXED | TILES

- TOKENS (kernels/lora/token.py): token-sized grids, two launches (shrink, expand);
- MIXED (kernels/lora/mixed.py): each adapter's rows of a decode batch as 16-row tiles,
  two launches, launch parameters from that module's own per-shape table;
- TILES (kernels/lora/segment.py): a grouped GEMM over a tile list (prefill), two launches.

Up to TOKEN_PATH_MAX_TOKENS tokens a call is a decode batch: a `uniform` one (the rows
share one adapter) takes TOKENS, a `spread` one (fewer rows per adapter than
`min_rows`) takes TOKENS, any other the table's entry for its GPU and shape class. Above
it, TILES. The hints come from the host (the caller counts its requests' slots), so
nothing here syncs with the device. The shrinks fused into the op before them
(kernels/lora/norm_shrink.py, silu_shrink.py) are asked for by the engine per step
(engine/lora/batch.py FUSED_NORM_SHRINK, FUSED_SILU_SHRINK, measured there) and finish
with the token expand.

Every entry names the measurement that chose it. "NOTES" below is the results notebook,
benchmarks/results/2026-11-27-h200-loads/NOTES.md, which holds the sections cited;
benchmarks/results/ holds the raw files.
"""
from __future__ import annotations

import functools

import torch

TOKENS = "tokens"
MIXED = "mixed"
TILES = "tiles"

# Decode batches: grids sized by tokens up to here (at most 256: the fused shrinks and the
# mixed kernels' counters are sized for it). Above, the tile list: NOTES "Performance
# round 3 and thousands of adapters: one NVIDIA H100, 2026-11-25 (evening)": the LoRA pair at
# M=8192 x 64 adapters at 84-94% of its floor against 18-32% for the row-block kernels it
# replaced, prefill 1.10x of base against 1.34x; "Performance round 3 measured again,
# 2026-11-27" on an H200: 1.088x against 1.31x (benchmarks/results/2026-11-27-h200/prefill.log).
TOKEN_PATH_MAX_TOKENS = 256

KINDS = ("qkv", "o", "gate_up", "down")

# (tokens bucket, layer kind) -> path, per GPU (a substring of the device name). An H200 has
# the H100's SMs and more bandwidth: it takes the H100's rows (_FALLBACK); unknown GPUs and
# the CPU interpreter take DEFAULT, the H100's choice by bucket.
# H100 rows: benchmarks/sweep_lora_mixed.py and bench_kernels.py on one H100 80GB HBM3,
# 2026-11-25 (NOTES "Performance round 3 and thousands of adapters", "Mixed decode
# above 64 tokens"; benchmarks/results/2026-11-25-h100/kernels.csv): 64 adapters round
# robin, rank 16, bf16, Llama-3-8B groups, us per group (both launches), token kernels ->
# segment tiles. The H200 took them unchanged in "Performance round 3 measured again,
# 2026-11-27" (benchmarks/results/2026-11-27-h200/kernels.csv, decode_before_after.json).
TABLE: dict[str, dict[tuple[int, str], str]] = {
    "H100": {
        (16, "qkv"): TOKENS,      # one program per token is a 16-row tile of one row here
        (16, "o"): TOKENS,
        (16, "gate_up"): TOKENS,
        (16, "down"): TOKENS,
        (64, "qkv"): TOKENS,      # 24.4 us (segment tiles 24.5)
        (64, "o"): TOKENS,        # 15.6 (16.7)
        (64, "gate_up"): TOKENS,  # 43.0 (48.7)
        (64, "down"): TOKENS,     # 30.3 (39.3)
        (128, "qkv"): MIXED,      # 37.3 -> 32.0
        (128, "o"): MIXED,        # 23.0 -> 19.1
        (128, "gate_up"): MIXED,  # 65.0 -> 52.3
        (128, "down"): MIXED,     # 41.1 -> 27.3
        (256, "qkv"): MIXED,      # 57.2 -> 36.7
        (256, "o"): MIXED,        # 34.0 -> 23.9
        (256, "gate_up"): MIXED,  # 108.7 -> 68.3
        (256, "down"): MIXED,     # 62.1 -> 31.0
    },
}
DEFAULT = TABLE["H100"]
_FALLBACK = {"H200": "H100"}

# Rows per adapter (rows with an adapter / distinct adapters) a mixed batch needs for the
# table's MIXED entries; fewer (`spread`): TOKENS, where a tile of one row reads its adapter
# as a token program does but costs more. H100, decode step at B=256 (NOTES
# 2026-11-25 "The regression"): 64 adapters (4 rows each) 19.20 ms on the token kernels,
# 16.62 on the segment tiles; 256 adapters (one row each) 22.03 on the token kernels,
# 25.65-29.91 on the segment tiles. The rule measured on both cards (2026-11-27 "The mixed
# decode path chosen by rows per adapter", benchmarks/results/2026-11-27-h100/
# decode_mixed_paths_norm_shrink.json, 2026-11-27-h200/decode_before_after.json): 256
# distinct adapters 25.66 -> 21.91 ms (H100), 24.11 -> 19.32 ms (H200), the rest unchanged.
MIN_ROWS_PER_ADAPTER: dict[str, int] = {"H100": 4}
DEFAULT_MIN_ROWS_PER_ADAPTER = 4

# A `uniform` batch: TOKENS with the launch parameters tuned for one adapter
# (kernels/lora/token.py default_split_k, measured by benchmarks/sweep_lora.py on an H200,
# benchmarks/results/sweep_lora.csv). A one-launch kernel for it measured slower on the H100
# (NOTES 2026-11-25 evening, "One adapter for all": 9.6-12.2 us against 5.9-7.5 us
# for the two launches at M 1-16) and is gone.

# Benchmarks only (bench_decode.py --mixed-paths, bench_kernels.py): a mixed decode batch
# takes this path whatever the table and the rule say ("table": the table, `spread`
# ignored). None in the engine: then the table and the rule decide.
FORCED: str | None = None

_DEFAULT_SMS = 132     # the interpreter and unknown devices size grids as an H100


def shape_class(T: int, S: int, K: int, widest: int) -> tuple[int, str]:
    """(tokens bucket, layer kind) of a call: T tokens, S slices, input width K, widest
    slice's output width."""
    bucket = 16 if T <= 16 else 64 if T <= 64 else 128 if T <= 128 else 256
    kind = ("qkv" if S >= 3 else "gate_up" if S == 2 else "down" if K > widest else "o")
    return bucket, kind


def gpu_key(name: str) -> str | None:
    """The table key of a device name ("NVIDIA H100 80GB HBM3" -> "H100"), else None."""
    return next((k for k in (*TABLE, *_FALLBACK) if k in name), None)


@functools.lru_cache(maxsize=None)
def device_facts(device: torch.device) -> tuple[str | None, int]:
    """(table key or None, SM count) of a device; the interpreter's are (None, 132)."""
    if device.type != "cuda":
        return None, _DEFAULT_SMS
    props = torch.cuda.get_device_properties(device)
    return gpu_key(props.name), props.multi_processor_count


def lookup(gpu: str | None, cls: tuple[int, str]) -> str:
    """The table's path for a GPU key (None: unknown) and shape class."""
    while gpu is not None:
        if cls in TABLE.get(gpu, {}):
            return TABLE[gpu][cls]
        gpu = _FALLBACK.get(gpu)
    return DEFAULT.get(cls, MIXED)


def min_rows(gpu: str | None, T: int) -> int:
    """Rows per adapter a mixed batch of T tokens needs on a GPU key (None: unknown) for
    the MIXED entries; 0 where the `spread` hint changes nothing (above
    TOKEN_PATH_MAX_TOKENS, or no layer kind at T tokens takes MIXED)."""
    if not 0 < T <= TOKEN_PATH_MAX_TOKENS:
        return 0
    bucket, _ = shape_class(T, 1, 1, 1)
    if all(lookup(gpu, (bucket, kind)) != MIXED for kind in KINDS):
        return 0
    while gpu is not None:
        if gpu in MIN_ROWS_PER_ADAPTER:
            return MIN_ROWS_PER_ADAPTER[gpu]
        gpu = _FALLBACK.get(gpu)
    return DEFAULT_MIN_ROWS_PER_ADAPTER


def choose(device: torch.device, tokens: int, uniform: bool, spread: bool, slices: int,
           k: int, widest: int) -> str:
    """The one path a call of `tokens` rows runs on this device: TOKENS, MIXED or TILES.
    uniform: the rows share one adapter; spread: fewer rows per adapter than `min_rows`;
    slices, k, widest: the projection group (slices, input width, widest slice)."""
    if tokens > TOKEN_PATH_MAX_TOKENS:
        return TILES
    if uniform:
        return TOKENS
    if FORCED in (TOKENS, MIXED):
        return FORCED
    if spread and FORCED != "table":
        return TOKENS
    return lookup(device_facts(torch.device(device))[0], shape_class(tokens, slices, k, widest))
