"""Tensor parallelism and replicas: `python -m benchmarks.parallel [CASE] --out DIR [options]`
(benchmarks/suite.py).

    decode     decode tok/s at --tp N (--allreduce auto|nccl|symm_mem, --async-scheduling
               on,off, --profile); --tiny: two gloo ranks on the CPU with the tiny model
    parity     TP=N against TP=1 on a tiny random Llama with adapters (bf16 on CUDA)
    allreduce  the one-shot all-reduce against NCCL: checks, then us per all-reduce
    table      the table over every decode_*.json (and allreduce.json) under --out
    replicas   one replica against N replicas against TP=N through the service
               (--layouts 1x1,2x1,1x2); --tiny: the demo model on the CPU
    failover   `loramux serve --replicas N` under load with one replica SIGKILLed: tok/s
               before, during and after, failed and changed streams (--tiny: the CPU)
"""
from __future__ import annotations

import sys

from benchmarks.suite import Case, main

_TP = "benchmarks.bench_tp"
CASES = {
    "decode": Case(_TP, "decode at TP=N", args=("decode",), tiny=("--device", "cpu"),
                   devices=("cuda", "cpu"), device_flag=True),
    "parity": Case(_TP, "TP=N against TP=1, tokens and logprobs", args=("parity",),
                   devices=("cuda", "cpu"), device_flag=True),
    "allreduce": Case(_TP, "one-shot all-reduce against NCCL", args=("allreduce",)),
    "table": Case(_TP, "the round's table from the JSON under --out", args=("table",),
                  devices=("cuda", "cpu")),
    "replicas": Case("benchmarks.bench_replicas", "replicas against TP through the service",
                     tiny=("--tiny",)),
    "failover": Case("benchmarks.bench_failover", "a replica killed under load",
                     tiny=("--tiny",)),
}

if __name__ == "__main__":
    sys.exit(main("parallel", CASES))
