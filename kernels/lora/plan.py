"""Which LoRA kernels run a call: one table, read by one function.

    choose(device, tokens, uniform, spread, slices, k, widest, rank) -> TOKENS | MIXED | TILES

- TOKENS (kernels/lora/token.py): token-sized grids, two launches (shrink, expand); every
  token reads its adapter's A and B, so its work grows with tokens x rank;
- MIXED (kernels/lora/mixed.py): each adapter's rows of a decode batch as 16-row tiles,
  two launches, launch parameters from that module's own per-shape table;
- TILES (kernels/lora/segment.py): a grouped GEMM over a tile list (prefill), two launches.

Up to TOKEN_PATH_MAX_TOKENS tokens a call is a decode batch, and the table
(kernels/lora/plan_table.py) names its form by GPU, projection group, rank bucket, token
bucket and one adapter (`uniform`) or many; a `spread` batch (fewer rows per adapter
than `min_rows`) takes TOKENS where the table says MIXED. Above it, TILES. The rank is
the slots' (the pool's max_lora_rank, `a`'s rank dimension): a host-side number fixed per
engine, so a captured graph's form never changes with the batch. The hints come from the
host (the caller counts its requests' slots), so nothing here syncs with the device. The
shrinks fused into the op before them (kernels/lora/norm_shrink.py, silu_shrink.py) are
asked for by the engine per step (engine/lora/batch.py FUSED_NORM_SHRINK,
FUSED_SILU_SHRINK, measured there) and finish with the token expand.

Every entry names the measurement that chose it (a file under benchmarks/results/), or
says it was not measured yet. "NOTES" below is the results notebook,
benchmarks/results/2026-11-27-h200-loads/NOTES.md, which holds the sections cited.
"""
from __future__ import annotations

import functools

import torch

from loramux_kernels.lora.plan_table import RANK_BUCKETS, TABLE, TOKEN_BUCKETS

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
FORMS = (TOKENS, MIXED, TILES)   # what the table's cells may name
DEFAULT = TABLE["H100"]   # unknown GPUs and the CPU interpreter: the H100's choice
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


def bucket(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= value (the largest for anything above it)."""
    return next((b for b in buckets if b >= value), buckets[-1])


def table_key(kind: str, rank: int, uniform: bool) -> tuple[str, int, str]:
    return kind, bucket(rank, RANK_BUCKETS), "one" if uniform else "many"


def lookup(gpu: str | None, kind: str, rank: int, tokens: int, uniform: bool) -> str:
    """The table's form for a GPU key (None: unknown), projection group, slot rank, token
    count (at most TOKEN_PATH_MAX_TOKENS) and one adapter or many."""
    key, column = table_key(kind, rank, uniform), TOKEN_BUCKETS.index(
        bucket(tokens, TOKEN_BUCKETS))
    while gpu is not None:
        if key in TABLE.get(gpu, {}):
            return TABLE[gpu][key][0][column]
        gpu = _FALLBACK.get(gpu)
    return DEFAULT[key][0][column]


def min_rows(gpu: str | None, T: int) -> int:
    """Rows per adapter a mixed batch of T tokens needs on a GPU key (None: unknown) for
    the MIXED entries; 0 where the `spread` hint changes nothing (above
    TOKEN_PATH_MAX_TOKENS, or no many-adapter entry at T tokens, any group or rank, takes
    MIXED)."""
    if not 0 < T <= TOKEN_PATH_MAX_TOKENS:
        return 0
    if all(lookup(gpu, kind, rank, T, False) != MIXED
           for kind in KINDS for rank in RANK_BUCKETS):
        return 0
    while gpu is not None:
        if gpu in MIN_ROWS_PER_ADAPTER:
            return MIN_ROWS_PER_ADAPTER[gpu]
        gpu = _FALLBACK.get(gpu)
    return DEFAULT_MIN_ROWS_PER_ADAPTER


def choose(device: torch.device, tokens: int, uniform: bool, spread: bool, slices: int,
           k: int, widest: int, rank: int) -> str:
    """The one path a call of `tokens` rows runs on this device: TOKENS, MIXED or TILES.
    uniform: the rows share one adapter; spread: fewer rows per adapter than `min_rows`;
    slices, k, widest: the projection group (slices, input width, widest slice); rank:
    the slots' rank (a [L, S, R, K]'s R)."""
    if tokens > TOKEN_PATH_MAX_TOKENS:
        return TILES
    if not uniform and FORCED in (TOKENS, MIXED):
        return FORCED
    if not uniform and spread and FORCED != "table":
        return TOKENS   # a tile of one row reads its adapter as a token does, at more cost
    _, kind = shape_class(tokens, slices, k, widest)
    return lookup(device_facts(torch.device(device))[0], kind, rank, tokens, uniform)
