"""Mixture-of-experts layer benchmark on Qwen1.5-MoE-A2.7B shapes (hidden 2048, 60 experts,
top 4, expert width 1408): the Triton grouped-GEMM path (kernels/moe_triton.py), alone and
with expert LoRA (4 slots of rank 16, tokens spread over them and base), against a bf16
loop over the experts present as transformers runs them, across token counts.

    python -m benchmarks.models moe --out DIR [--quick] [--no-engine]

Measures the device copy bandwidth in the same run; for every case checks the Triton
result against the float32 torch reference (kernels/moe_ref.py) first, then times
(triton.testing.do_bench, median, L2 flushed). The floor is the expert weights the batch
touches read once (distinct experts x 3 x hidden x width x 2 bytes; LoRA factors left
out), divided by the measured bandwidth. Writes moe.csv to DIR and prints a short table.

Then the whole model through the engine: a Qwen1.5-MoE-A2.7B-shaped model (24 layers,
random bf16 weights, load_format="dummy") decoding at several batch sizes with no
adapter, one rank-16 adapter on attention + every expert (PEFT target_parameters) for all
requests, and 4 such adapters spread over the requests: tokens/s and ms per step
(engine.csv, a second table). Needs CUDA.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
from benchmarks.common import copy_bandwidth, count_launches, time_do_bench, write_csv  # noqa: E402
from loramux_kernels import moe, moe_triton  # noqa: E402
from loramux_kernels.moe_ref import route_ref  # noqa: E402

QWEN15_MOE = dict(
    architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", vocab_size=151936,
    hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
    shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
    num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
    max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=1000000.0,
    norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True,
    tie_word_embeddings=False, torch_dtype="bfloat16", hidden_act="silu",
    use_sliding_window=False, bos_token_id=151643, eos_token_id=151643)

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 60, 4, 1408
SLOTS, RANK = 4, 16


def make_case(T: int, lora: bool, gen: torch.Generator, dev: str = "cuda"):
    bf16 = torch.bfloat16
    x = torch.randn(T, HIDDEN, device=dev, dtype=bf16, generator=gen)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, dtype=bf16, generator=gen) * HIDDEN ** -0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=dev, dtype=bf16, generator=gen) * INTER ** -0.5
    logits = torch.randn(T, EXPERTS, device=dev, generator=gen)
    weights, ids = route_ref(logits, TOP_K, norm_topk_prob=False)
    weights = weights.to(bf16)
    exp_lora = None
    if lora:
        slots = torch.randint(-1, SLOTS, (T,), device=dev, generator=gen)
        def f(*shape):
            return torch.randn(*shape, device=dev, dtype=bf16, generator=gen) * 0.05
        exp_lora = moe.ExpertLoRA(slots, f(SLOTS, EXPERTS, RANK, HIDDEN),
                                  f(SLOTS, EXPERTS, 2 * INTER, RANK),
                                  f(SLOTS, EXPERTS, RANK, INTER), f(SLOTS, EXPERTS, HIDDEN, RANK))
    return x, w13, w2, weights, ids, exp_lora


def floor_bytes(ids: torch.Tensor) -> int:
    """The expert weights the batch routes to, read once (bf16)."""
    return int(torch.unique(ids).numel()) * 3 * HIDDEN * INTER * 2


def hf_loop(x, w13, w2, weights, ids):
    """transformers' Qwen2MoeExperts.forward: one pair of matmuls per expert hit."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, j = torch.where(ids == e)
        gate, up = torch.nn.functional.linear(x[tok], w13[e]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[e])
        out.index_add_(0, tok, y * weights[tok, j, None])
    return out


def _checked(T, lora, gen, dev="cuda"):
    case = make_case(T, lora, gen, dev)
    ref = moe._run(None, *case)
    got = moe._run(moe_triton, *case)
    err = float((got.float() - ref.float()).norm() / ref.float().norm())
    assert err < 3e-2, f"T={T} lora={lora}: relative error {err:.3g} against the reference"
    return case, err


def run(out_dir: Path, quick: bool) -> list[dict]:
    bw = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for T in ([1, 64, 512] if quick else [1, 8, 32, 64, 128, 256, 512, 2048]):
        (x, w13, w2, weights, ids, _), err = _checked(T, False, gen)
        lora_case, lora_err = _checked(T, True, gen)
        t_triton = time_do_bench(lambda: moe._run(moe_triton, x, w13, w2, weights, ids, None))
        t_lora = time_do_bench(lambda: moe._run(moe_triton, *lora_case))
        t_hf = time_do_bench(lambda: hf_loop(x, w13, w2, weights, ids))
        if not rows:   # kernels one call launches, at the smallest batch
            launches = (count_launches(lambda: moe._run(moe_triton, x, w13, w2, weights, ids,
                                                        None)),
                        count_launches(lambda: moe._run(moe_triton, *lora_case)))
        floor = floor_bytes(ids) / bw
        rows.append(dict(tokens=T, triton_us=t_triton * 1e6, triton_lora_us=t_lora * 1e6,
                         lora_overhead_pct=100 * (t_lora / t_triton - 1),
                         hf_loop_us=t_hf * 1e6, speedup_vs_hf=t_hf / t_triton,
                         floor_us=floor * 1e6, pct_of_floor=100 * floor / t_triton,
                         rel_err=max(err, lora_err)))
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(out_dir / "moe.csv", rows)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}; kernels "
          f"launched per call at {rows[0]['tokens']} token(s): {launches[0]}, with LoRA "
          f"{launches[1]}")
    print(f"{'tokens':>6} {'triton us':>10} {'+LoRA us':>9} {'LoRA %':>7} {'HF loop us':>11} "
          f"{'speedup':>8} {'floor us':>9} {'% floor':>8}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['triton_us']:>10.1f} {r['triton_lora_us']:>9.1f} "
              f"{r['lora_overhead_pct']:>6.1f}% {r['hf_loop_us']:>11.1f} "
              f"{r['speedup_vs_hf']:>8.2f} {r['floor_us']:>9.1f} {r['pct_of_floor']:>7.1f}%")
    return rows


def write_expert_adapter(path: Path, cfg: dict, rank: int = RANK, seed: int = 0) -> Path:
    """A random rank-`rank` adapter in PEFT layout on q/k/v/o and on both fused expert
    parameters (target_parameters: PEFT nests gate_up_proj's wrapper one level deeper)."""
    import json

    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    h, q, E, inter = cfg["hidden_size"], cfg["num_attention_heads"] * cfg["head_dim"], \
        cfg["num_experts"], cfg["moe_intermediate_size"]

    def pair(key, fin, fout, r):
        for f, shape in (("A", (r, fin)), ("B", (fout, r))):
            tensors[f"{key}.lora_{f}.weight"] = (torch.randn(shape, generator=gen) * 0.01).bfloat16()
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"base_model.model.model.layers.{layer}"
        for mod, fout in (("q_proj", q), ("k_proj", q), ("v_proj", q)):
            pair(f"{p}.self_attn.{mod}", h, fout, rank)
        pair(f"{p}.self_attn.o_proj", q, h, rank)
        pair(f"{p}.mlp.experts.base_layer", h, 2 * inter, rank * E)  # gate_up_proj
        pair(f"{p}.mlp.experts", inter, h, rank * E)                 # down_proj
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "lora_dropout": 0.0,
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}))
    return path


def engine_rows(out_dir: Path, batches: list[int], steps: int = 20, prompt_len: int = 128):
    """Decode tokens/s of the MoE model through the engine (module docstring)."""
    from benchmarks.bench_decode import HostTimer, make_engine, time_decode
    from benchmarks.llama8b import write_model_dir

    model_dir = write_model_dir(out_dir / "qwen15_moe", base=QWEN15_MOE)
    files = [write_expert_adapter(out_dir / f"expert_lora{i}", QWEN15_MOE, seed=i)
             for i in range(4)]
    eng = make_engine(model_dir, 4, max(batches), False, prompt_len, steps)
    for i, f in enumerate(files):
        eng.add_adapter(f"a{i}", str(f))
    timer, gen, rows = HostTimer(eng), torch.Generator().manual_seed(0), []
    for b in batches:
        for mode, names in (("base", [None] * b), ("one", ["a0"] * b),
                            ("four", [f"a{i % 4}" for i in range(b)])):
            t = time_decode(eng, timer, b, names, prompt_len, steps, gen)
            rows.append(dict(batch=b, mode=mode, step_ms=t["step"] * 1e3,
                             tokens_per_s=b / t["step"], gpu_ms=t["gpu"] * 1e3))
    eng.close()
    write_csv(out_dir / "engine.csv", rows)
    print(f"{'batch':>5} {'adapters':>8} {'ms/step':>8} {'tokens/s':>9} {'graph ms':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['mode']:>8} {r['step_ms']:>8.2f} {r['tokens_per_s']:>9.0f} "
              f"{r['gpu_ms']:>9.2f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-engine", action="store_true", help="the MoE layer table only")
    args = ap.parse_args()
    run(args.out, args.quick)
    if not args.no_engine:
        engine_rows(args.out, [1, 16] if args.quick else [1, 16, 64, 128])


if __name__ == "__main__":
    main()
