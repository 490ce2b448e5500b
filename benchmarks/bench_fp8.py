"""FP8 base weights against bf16 on Llama-3-8B shapes (random weights, nothing downloaded):
accuracy and speed of the FP8 GEMM path (kernels/fp8.py: per-channel weight scales,
per-token activation scales, torch._scaled_mm) in one command.

    python -m benchmarks.models fp8 --out DIR [--layers 32] [--quick]

1. GEMMs: every projection shape (qkv, o, gate_up, down) at several token counts: bf16
   F.linear against fp8_linear (activation quantization included), both timed with
   triton.testing.do_bench (median, L2 flushed); relative L2 error of the FP8 output
   against the bf16 product on the same data. Beside them, the bare torch._scaled_mm on
   already quantized activations (default accumulation, and use_fast_accum=True) and the
   kernels one fp8_linear call launches: what the GEMM costs apart from the quantization.
2. The model: a bf16 model with dummy weights and its FP8 twin (every projection
   quantized per output row from the bf16 weights; embeddings, norms and head shared):
   prefill logits on random prompts (relative L2 error, top-1 agreement with bf16), and one
   decode step of 64 sequences at 128 tokens of context (eager, median of CUDA-event
   timings), weight bytes of each.

Writes gemm.csv and model.csv to DIR and prints two short tables. Needs CUDA (Hopper for
FP8 tensor cores).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
from benchmarks.common import count_launches, time_do_bench, write_csv  # noqa: E402
from benchmarks.llama8b import write_model_dir  # noqa: E402
from loramux_engine.model.batch import make_attention_metadata  # noqa: E402
from loramux_engine.model.dummy import init_dummy_weights  # noqa: E402
from loramux_core.model.hf_config import ModelConfig  # noqa: E402
from loramux_engine.model.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from loramux_engine.model.llama import LlamaForCausalLM  # noqa: E402
from loramux_kernels.fp8 import FP8_MAX, fp8_linear, quantize_rows  # noqa: E402
from loramux_kernels.fp8_triton import quantize_rows as quantize_rows_kernel  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
BLOCK = 16


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def gemm_rows(tokens: list[int]) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (K, N) in SHAPES.items():
        w = torch.randn(N, K, device="cuda", generator=gen).mul_(K ** -0.5).bfloat16()
        wq, ws = quantize_rows(w)
        ws = ws.view(-1)
        for M in tokens:
            x = torch.randn(M, K, device="cuda", generator=gen).bfloat16()
            ref = F.linear(x, w)
            err = rel_err(fp8_linear(x, wq, ws), ref)
            t_bf16 = time_do_bench(lambda: F.linear(x, w))
            t_fp8 = time_do_bench(lambda: fp8_linear(x, wq, ws))
            xq, xs = quantize_rows_kernel(x, FP8_MAX)
            bare = {fast: time_do_bench(lambda fast=fast: torch._scaled_mm(
                xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16,
                use_fast_accum=fast)) for fast in (False, True)}
            launches = count_launches(lambda: fp8_linear(x, wq, ws)) if M == tokens[0] else -1
            rows.append(dict(gemm=name, tokens=M, bf16_us=t_bf16 * 1e6, fp8_us=t_fp8 * 1e6,
                             speedup=t_bf16 / t_fp8, rel_err=err,
                             scaled_mm_us=bare[False] * 1e6, fast_accum_us=bare[True] * 1e6,
                             launches=launches))
    return rows


@torch.no_grad()
def fp8_twin(dense: LlamaForCausalLM, cfg: ModelConfig) -> LlamaForCausalLM:
    """The FP8-GEMM model with `dense`'s weights, projections quantized per row."""
    twin = LlamaForCausalLM(cfg, torch.bfloat16, "cuda", fp8=True)
    for name, mod in dense.named_modules():
        if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
            target = twin.get_submodule(name)
            q, s = quantize_rows(mod.weight)
            target.weight.copy_(q)
            target.weight_scale.copy_(s.view(-1))
    fp8_params = dict(twin.named_parameters())
    for name, p in dense.named_parameters():
        other = fp8_params[name]
        if other.dtype == p.dtype and other.shape == p.shape:
            other.copy_(p)
    return twin


def _decode_time(model: LlamaForCausalLM, batch: int, context: int) -> float:
    blocks = -(-(context + 1) // BLOCK)
    tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(batch)]
    kv = model.make_kv_caches(batch * blocks, BLOCK)
    ids = torch.randint(0, model.cfg.vocab_size, (batch * context,), device="cuda")
    model(ids, make_attention_metadata(tables, [0] * batch, [context] * batch, BLOCK, "cuda"), kv)
    step = make_attention_metadata(tables, [context] * batch, [1] * batch, BLOCK, "cuda")
    last = ids[context - 1::context]
    for _ in range(3):
        model(last, step, kv)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(last, step, kv)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del kv
    return statistics.median(times)


@torch.no_grad()
def model_rows(layers: int, work: Path) -> list[dict]:
    cfg = ModelConfig.from_dir(write_model_dir(work / "llama8b", num_layers=layers))
    dense = LlamaForCausalLM(cfg, torch.bfloat16, "cuda")
    init_dummy_weights(dense, seed=0)
    twin = fp8_twin(dense, cfg)
    gen = torch.Generator(device="cuda").manual_seed(1)
    n, length = 4, 256
    prompts = torch.randint(0, cfg.vocab_size, (n * length,), device="cuda", generator=gen)
    tables = [list(range(b * 16, (b + 1) * 16)) for b in range(n)]
    attn = make_attention_metadata(tables, [0] * n, [length] * n, BLOCK, "cuda")
    logits = {}
    for name, model in (("bf16", dense), ("fp8", twin)):
        kv = model.make_kv_caches(n * 16, BLOCK)
        logits[name] = model.compute_logits(model(prompts, attn, kv))
        del kv
    agree = float((logits["fp8"].argmax(-1) == logits["bf16"].argmax(-1)).float().mean())
    rows = []
    for name, model in (("bf16", dense), ("fp8", twin)):
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        rows.append(dict(model=name, layers=layers, weight_gb=weight_bytes / 1e9,
                         decode_b64_ms=_decode_time(model, 64, 128) * 1e3,
                         logits_rel_err=0.0 if name == "bf16" else rel_err(logits["fp8"],
                                                                             logits["bf16"]),
                         top1_agree=1.0 if name == "bf16" else agree))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="fewer token counts, 4 layers")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokens = [1, 64, 1024] if args.quick else [1, 16, 64, 256, 1024, 4096]
    gemms = gemm_rows(tokens)
    models = model_rows(4 if args.quick else args.layers, args.out)
    write_csv(args.out / "gemm.csv", gemms)
    write_csv(args.out / "model.csv", models)
    print(torch.cuda.get_device_name())
    print(f"{'gemm':>8} {'tokens':>6} {'bf16 us':>9} {'fp8 us':>9} {'speedup':>8} {'rel err':>8}"
          f" {'mm us':>8} {'fast us':>8} {'launches':>8}")
    for r in gemms:
        print(f"{r['gemm']:>8} {r['tokens']:>6} {r['bf16_us']:>9.1f} {r['fp8_us']:>9.1f} "
              f"{r['speedup']:>8.2f} {r['rel_err']:>8.4f} {r['scaled_mm_us']:>8.1f} "
              f"{r['fast_accum_us']:>8.1f} {r['launches'] if r['launches'] >= 0 else '':>8}")
    print(f"{'model':>6} {'layers':>6} {'weights GB':>10} {'decode b64 ms':>13} "
          f"{'logits err':>10} {'top-1 agree':>11}")
    for r in models:
        print(f"{r['model']:>6} {r['layers']:>6} {r['weight_gb']:>10.2f} "
              f"{r['decode_b64_ms']:>13.2f} {r['logits_rel_err']:>10.4f} {r['top1_agree']:>11.3f}")


if __name__ == "__main__":
    main()
