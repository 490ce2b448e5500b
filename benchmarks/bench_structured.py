"""Constrained decoding on the Llama-3-8B shape (random bf16 weights, nothing downloaded):
the decode step at batch 64 with 64 adapters when 0%, 25% and 100% of the rows are under
a JSON schema, and the grammar compile time over real-size schemas.

    python -m benchmarks.decode structured --out DIR [--batch 64] [--steps 32]
        [--fractions 0,0.25,1] [--repeats 20]

The tokenizer is a byte-level BPE of about 128k tokens (Llama-3's layout: the regular
tokens, then 256 specials, <|end_of_text|> the EOS) trained here with `tokenizers` on the
Python standard library's sources (topped up with merges of random token pairs where
they run out of merges): no real 128k tokenizer is downloaded, and the token trie
llguidance walks is of the real size. Decode: every row prefills a
128-token prompt, then `--steps` engine steps are timed one by one (median); constrained
rows write a document of at least 40 records (structured_schemas.LONG), so none ends
inside the timed steps. "fill ms" is the host time of the mask fill per step (it overlaps
the forward pass). Compile: each schema `--repeats` times, each time as a new text (its
"description" differs), so nothing comes from the cache; the tokenizer's one-time build
is reported apart. Writes DIR/structured.json; prints a short table. --device cpu --tiny
runs the same flow on a 2-layer toy model and a small tokenizer (tests).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
from benchmarks.bench_prefill import TINY, make_engine  # noqa: E402
from benchmarks.llama8b import LLAMA3_8B, write_adapter, write_model_dir  # noqa: E402
from benchmarks.structured_schemas import LONG, SCHEMAS  # noqa: E402

RANK, NUM_ADAPTERS, NUM_ADAPTER_FILES, PROMPT = 16, 64, 4, 128
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]


def train_tokenizer(path: Path, regular: int, specials: int, max_files: int | None) -> int:
    """A byte-level BPE of `regular` tokens then `specials` special tokens; returns the EOS
    id. Where the corpus runs out of merges first (a Python without its tests), the rest
    are merges of two random tokens: the trie llguidance walks keeps its full size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(str(f) for f in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files[:max_files], trainers.BpeTrainer(
        vocab_size=regular, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    data = json.loads(tok.to_str())
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    trained, rng = list(vocab), random.Random(0)
    while len(vocab) < regular:
        a, b = rng.choice(trained), rng.choice(trained)
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
            merges.append([a, b])
    tok = Tokenizer.from_str(json.dumps(data))
    names = SPECIALS + [f"<|reserved_special_token_{i}|>" for i in range(specials - len(SPECIALS))]
    tok.add_special_tokens(names[:specials])
    tok.save(str(path))
    return tok.token_to_id("<|end_of_text|>")


def write_model(work: Path, tiny: bool) -> tuple[Path, dict]:
    cfg = dict(TINY if tiny else LLAMA3_8B)
    model_dir = write_model_dir(work / "model", base=cfg)
    eos = train_tokenizer(model_dir / "tokenizer.json", 300 if tiny else 128000,
                          8 if tiny else 256, 40 if tiny else None)
    cfg["eos_token_id"] = eos
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return model_dir, cfg


def compile_times(eng, repeats: int) -> dict:
    """Milliseconds per compile (one at a time, none cached) and the tokenizer's build."""
    from loramux_core.structured import StructuredOutput

    compiler = eng.grammars.compiler
    t0 = time.perf_counter()
    compiler.tokenizer()
    tokenizer_s = time.perf_counter() - t0
    per, every = {}, []
    for name, schema in SCHEMAS.items():
        times = []
        for r in range(repeats):
            s = StructuredOutput("json_schema", json.dumps({**schema, "description": f"{r}"}))
            t0 = time.perf_counter()
            compiler.submit(s).result()
            times.append((time.perf_counter() - t0) * 1e3)
        per[name] = statistics.median(times)
        every += times
    every.sort()
    return {"tokenizer_s": tokenizer_s, "p50_ms": statistics.median(every),
            "p99_ms": every[min(len(every) - 1, round(0.99 * (len(every) - 1)))],
            "per_schema_p50_ms": per}


class FillTimer:
    """Host seconds in the engine's mask fill (Grammars.fill), per call."""

    def __init__(self, eng):
        self.times: list[float] = []
        fill = eng.grammars.fill

        def timed(requests):
            t0 = time.perf_counter()
            try:
                return fill(requests)
            finally:
                self.times.append(time.perf_counter() - t0)
        eng.grammars.fill = timed


def decode_round(eng, fraction: float, args, names, vocab: int, tag: str) -> dict:
    """Median step seconds at `args.batch` rows, `fraction` of them constrained."""
    from loramux_core.sampling import SamplingParams
    from loramux_core.structured import StructuredOutput

    tied = round(args.batch * fraction)
    s = StructuredOutput("json_schema", json.dumps(LONG))
    gen = torch.Generator().manual_seed(7)
    for i in range(args.batch):
        p = SamplingParams(temperature=0.0, max_tokens=args.steps + 16, ignore_eos=True,
                           structured=s if i < tied else None)
        eng.add_request(f"{tag}-{i}", torch.randint(10, vocab, (PROMPT,), generator=gen).tolist(),
                        p, names[i % len(names)])
    reqs = [eng.scheduler.get(f"{tag}-{i}") for i in range(args.batch)]
    while any(r.num_output_tokens < 2 for r in reqs):   # prefilled, in steady decode
        eng.step()
    timer = FillTimer(eng)
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        eng.step()
        sync()
        times.append(time.perf_counter() - t0)
    del eng.grammars.fill   # the instance's timer off: the class's method again
    alive = sum(1 for r in reqs[:tied] if not r.is_finished)
    for r in reqs:
        eng.abort(r.request_id)
    eng.flush()
    return {"fraction": fraction, "constrained": tied, "constrained_at_end": alive,
            "step_ms": statistics.median(times) * 1e3,
            "fill_ms": statistics.mean(timer.times) * 1e3 if timer.times else 0.0}


def bench(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="loramux-structured-"))
    model_dir, cfg = write_model(work, args.tiny)
    files = [write_adapter(work / f"adapter{i}", model_dir, RANK, seed=i)
             for i in range(NUM_ADAPTER_FILES)]
    eng = make_engine(model_dir, args.device, args.batch, PROMPT + args.steps + 16)
    names = [f"a{i}" for i in range(NUM_ADAPTERS)]
    for i, name in enumerate(names):
        eng.add_adapter(name, str(files[i % len(files)]))
    vocab = eng.tokenizer.vocab_size
    regular = vocab - (8 if args.tiny else 256)   # prompts: no special tokens
    print(f"device {args.device}: tokenizer {vocab} ids, model vocab {cfg['vocab_size']}",
          flush=True)
    compiles = compile_times(eng, args.repeats)
    fractions = [float(f) for f in args.fractions.split(",")]
    decode_round(eng, fractions[-1], args, names, regular, "warm")  # compiles, graphs
    rows = [decode_round(eng, f, args, names, regular, f"t{f}") for f in fractions]
    base = rows[0]["step_ms"]
    for r in rows:
        r["x_free"] = r["step_ms"] / base
    eng.close()
    result = {"meta": {"device": args.device, "batch": args.batch, "steps": args.steps,
                       "tokenizer_ids": vocab, "argv": sys.argv, "torch": torch.__version__,
                       "date": time.strftime("%Y-%m-%d")},
              "compile": compiles, "decode": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured.json").write_text(json.dumps(result, indent=2))
    return result


def table(result: dict) -> str:
    lines = ["| constrained | rows | step ms | x free | fill ms |", "|---|---|---|---|---|"]
    for r in result["decode"]:
        lines.append(f"| {r['fraction']:.0%} | {r['constrained']} | {r['step_ms']:.2f} | "
                     f"{r['x_free']:.3f} | {r['fill_ms']:.2f} |")
    c = result["compile"]
    lines.append(f"\ncompile over {len(c['per_schema_p50_ms'])} schemas: p50 {c['p50_ms']:.2f} ms,"
                 f" p99 {c['p99_ms']:.2f} ms (tokenizer built once in {c['tokenizer_s']:.2f} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--fractions", default="0,0.25,1")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer toy model (tests)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_structured needs a CUDA GPU (or --device cpu --tiny)", file=sys.stderr)
        return 2
    print("\n" + table(bench(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
