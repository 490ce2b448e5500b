"""The engine replicas a gateway or control plane talks to, from its command line.

`--engine-input` and `--engine-output` take one address per replica, comma-separated and
in the same order: the position is the replica's index (its `replica` label in metrics,
its entry in AdapterAdmin's per-replica residency)."""
from __future__ import annotations

import os


def add_arguments(parser) -> None:
    env = os.environ.get
    parser.add_argument("--engine-input", default=env("LORAMUX_ENGINE_INPUT"),
                        help="the engine replicas' input addresses, comma-separated "
                             "($LORAMUX_ENGINE_INPUT)")
    parser.add_argument("--engine-output", default=env("LORAMUX_ENGINE_OUTPUT"),
                        help="their output addresses, in the same order "
                             "($LORAMUX_ENGINE_OUTPUT)")


def addresses(inputs: str, outputs: str) -> list[tuple[str, str]]:
    """(input, output) per replica, by replica index; ValueError says what is wrong."""
    ins = [a.strip() for a in inputs.split(",")]
    outs = [a.strip() for a in outputs.split(",")]
    if "" in ins or "" in outs:
        raise ValueError("--engine-input/--engine-output: an empty address in the list")
    if len(ins) != len(outs):
        raise ValueError(f"--engine-input names {len(ins)} replica(s) and --engine-output "
                         f"{len(outs)}: give one input and one output address per replica")
    return list(zip(ins, outs))
