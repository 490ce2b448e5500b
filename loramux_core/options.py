"""Command-line options, one table per part, each row naming the config field it sets.

The engine server (`python -m loramux_engine.server`) and `loramux serve` build their flags from
ENGINE_OPTIONS, so a flag cannot drift from EngineConfig (tests/test_serve_options.py
checks that every field but `model` has a row). A flag not given is None in the parsed
namespace: the environment variable of its row is the second way, the config's own
default the third; `loramux serve` forwards only what was given (`to_argv`).

Parsers raise argparse.ArgumentTypeError, so argparse names the flag in one line."""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loramux_core.engine_config import LORA_EXTRAS


@dataclass(frozen=True)
class Option:
    dest: str                       # the config field (or parsed-namespace name) it sets
    flag: str                       # "--max-loras"
    parse: Callable[[str], Any] | None  # text -> value; None: an on/off switch
    help: str                       # says the default ("auto: ...") as users see it
    env: str | None = None          # a second way to set it
    tri_state: bool = False         # with parse: the bare flag means True ("--async-scheduling")
    default: Any = None             # None: the config's own default decides

    @property
    def metavar(self) -> str | None:
        names = getattr(self.parse, "names", None)
        if names:
            return "{" + ",".join(names) + "}"
        return _METAVARS.get(getattr(self.parse, "__name__", ""))

    def add_to(self, parser) -> None:
        if self.parse is None:
            parser.add_argument(self.flag, dest=self.dest, default=None,
                                action=argparse.BooleanOptionalAction, help=self.help)
        elif self.tri_state:
            parser.add_argument(self.flag, dest=self.dest, default=None, type=self.parse,
                                nargs="?", const=True, help=self.help, metavar=self.metavar)
        else:
            parser.add_argument(self.flag, dest=self.dest, default=None, type=self.parse,
                                help=self.help, metavar=self.metavar)

    def argv(self, value) -> list[str]:
        """The flag that gives `value` back when parsed."""
        if self.parse is None:
            return [self.flag if value else "--no-" + self.flag[2:]]
        if self.tri_state and isinstance(value, bool):
            return [self.flag, "on" if value else "off"]
        if isinstance(value, (tuple, list)):
            return [self.flag, ",".join(value)]
        return [self.flag, "auto" if value is None else str(value)]


class OneLineErrors(argparse.ArgumentParser):
    """A parser whose errors are one line naming the flag (no usage block: --help has it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


# ---- value parsers ---------------------------------------------------------------------

def _int(text: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def auto_positive_int(text: str) -> int | None:
    """A positive integer, or None for "auto" (decided by engine/resolve.py)."""
    return None if str(text).lower() == "auto" else positive_int(text)


def auto_non_negative_int(text: str) -> int | None:
    """An integer >= 0, or None for "auto" (decided by engine/resolve.py)."""
    return None if str(text).lower() == "auto" else non_negative_int(text)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} must be a number > 0")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text} must be a number >= 0")
    return value


def fraction(text: str) -> float:
    value = positive_float(text)
    if value > 1.0:
        raise argparse.ArgumentTypeError(f"{text} must be in (0, 1]")
    return value


def choice(*names: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(names)}")
        return text
    parse.names = names
    return parse


def names_of(*names: str) -> Callable[[str], tuple[str, ...]]:
    """A comma-separated list of some of `names` (empty: none)."""
    def parse(text: str) -> tuple[str, ...]:
        out = tuple(n for n in text.split(",") if n)
        for n in out:
            if n not in names:
                raise argparse.ArgumentTypeError(f"{n!r} is not one of {', '.join(names)}")
        return out
    parse.names = names
    return parse


def device(text: str) -> str:
    if text in ("auto", "cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not auto, cpu, cuda or cuda:N")


def on_off_auto(text: str) -> bool | None:
    """"auto" -> None, on/true -> True, off/false -> False."""
    value = {"auto": None, "on": True, "true": True, "off": False, "false": False}.get(
        str(text).lower(), "?")
    if value == "?":
        raise argparse.ArgumentTypeError(f"{text!r} is not on, off or auto")
    return value


_METAVARS = {"positive_int": "N", "non_negative_int": "N", "auto_positive_int": "N|auto",
             "auto_non_negative_int": "N|auto",
             "positive_float": "X", "non_negative_float": "X", "fraction": "F",
             "device": "auto|cpu|cuda[:N]", "on_off_auto": "on|off|auto"}


# ---- the engine's table ----------------------------------------------------------------

ENGINE_OPTIONS: tuple[Option, ...] = (
    Option("device", "--device", device,
           "auto (default: CUDA when a GPU is present, else cpu), cpu, cuda or cuda:N",
           env="LORAMUX_DEVICE"),
    Option("dtype", "--dtype", choice("auto", "bfloat16", "float16", "float32"),
           "auto (default: bfloat16 on GPUs that support it, else float16; float32 on the "
           "CPU), bfloat16, float16 or float32", env="LORAMUX_DTYPE"),
    Option("tp_size", "--tensor-parallel-size", positive_int,
           "GPUs (processes on the CPU) the model is split over (default: 1)",
           env="LORAMUX_TP_SIZE"),
    Option("max_loras", "--max-loras", auto_positive_int,
           "adapter slots on the device, also the most distinct adapters in one batch "
           "(default: auto: as many as 40%% of the GPU memory left after weights and "
           "activations holds, at most 512; 4 on the CPU)", env="LORAMUX_MAX_LORAS"),
    Option("max_cpu_loras", "--max-cpu-loras", auto_positive_int,
           "adapter copies kept in host memory, >= --max-loras (default: auto: as many as "
           "half the available host memory holds; 4 x max_loras on the CPU)",
           env="LORAMUX_MAX_CPU_LORAS"),
    Option("max_lora_rank", "--max-lora-rank", positive_int,
           "largest adapter rank accepted; sizes the slots and host copies (default: 16)",
           env="LORAMUX_MAX_LORA_RANK"),
    Option("max_num_seqs", "--max-num-seqs", auto_positive_int,
           "requests running at once (default: auto: 256 on a GPU, 64 on the CPU)",
           env="LORAMUX_MAX_NUM_SEQS"),
    Option("max_num_batched_tokens", "--max-num-batched-tokens", auto_positive_int,
           "tokens per engine step, prefill chunks included (default: auto: 8192 on a GPU, "
           "512 on the CPU)", env="LORAMUX_MAX_NUM_BATCHED_TOKENS"),
    Option("max_model_len", "--max-model-len", auto_positive_int,
           "prompt + output tokens per request (default: auto: the model's "
           "max_position_embeddings)", env="LORAMUX_MAX_MODEL_LEN"),
    Option("gpu_memory_utilization", "--gpu-memory-utilization", fraction,
           "share of the GPU's memory this engine may use; the KV cache gets what weights, "
           "adapter slots and activations leave (default: 0.9)",
           env="LORAMUX_GPU_MEMORY_UTILIZATION"),
    Option("num_kv_blocks", "--num-kv-blocks", auto_positive_int,
           "KV cache blocks (default: auto: sized from --gpu-memory-utilization; 1024 on "
           "the CPU)", env="LORAMUX_NUM_KV_BLOCKS"),
    Option("block_size", "--block-size", positive_int,
           "tokens per KV cache block (default: 16)", env="LORAMUX_BLOCK_SIZE"),
    Option("enable_prefix_caching", "--enable-prefix-caching", None,
           "reuse KV blocks of earlier requests with the same prefix and adapter "
           "(default: on)", env="LORAMUX_ENABLE_PREFIX_CACHING"),
    Option("enforce_eager", "--enforce-eager", None,
           "no CUDA graphs (default: off: graphs for decode steps on GPUs)",
           env="LORAMUX_ENFORCE_EAGER"),
    Option("async_scheduling", "--async-scheduling", on_off_auto,
           "on, off or auto: launch step N+1 before reading step N's tokens (default: "
           "auto: on for CUDA devices, off on the CPU; the bare flag means on)",
           env="LORAMUX_ASYNC_SCHEDULING", tri_state=True),
    Option("cpu_threads", "--cpu-threads", auto_positive_int,
           "torch threads on the CPU device (default: auto: $OMP_NUM_THREADS if set, else "
           "the cores this process may use, shared among tensor-parallel ranks)",
           env="LORAMUX_CPU_THREADS"),
    Option("seed", "--seed", non_negative_int,
           "seed of the engine's random sampling (default: 0)", env="LORAMUX_SEED"),
    Option("load_format", "--load-format", choice("auto", "dummy"),
           "auto (default: the model's safetensors) or dummy (random weights of the "
           "model's shapes, for benchmarks)", env="LORAMUX_LOAD_FORMAT"),
    Option("adapter_loaders", "--adapter-loaders", auto_non_negative_int,
           "processes per rank that read, check and convert adapters into shared host "
           "memory, off the engine process, at a lower priority (default: auto: the "
           "rank's cores less two, 2 to 16; 0: on threads of the engine process)",
           env="LORAMUX_ADAPTER_LOADERS"),
    Option("host_reserve_loras", "--host-reserve-loras", auto_non_negative_int,
           "host buffers for adapter copies made ready at start, in the background "
           "(allocated, populated, page-locked on CUDA), so the first loads into the host "
           "tier find them ready (default: auto: max_cpu_loras on CUDA at tensor-parallel "
           "size 1, bounded by host memory; 0 on the CPU; 0: none)",
           env="LORAMUX_HOST_RESERVE_LORAS"),
    Option("tp_allreduce", "--tp-allreduce", choice("auto", "nccl", "symm_mem"),
           "all-reduce under tensor parallelism on GPUs (default: auto: one-shot over "
           "symmetric memory for decode-sized messages where possible, else NCCL)",
           env="LORAMUX_TP_ALLREDUCE"),
    Option("lora_extras", "--lora-extras", names_of(*LORA_EXTRAS),
           "comma-separated adapter features whose device buffers are taken at start, so "
           f"the warm-up compiles and captures their steps: {', '.join(LORA_EXTRAS)} "
           "(default: none: taken at the first such adapter's read, whose first steps "
           "then compile)", env="LORAMUX_LORA_EXTRAS"),
)
BY_DEST = {o.dest: o for o in ENGINE_OPTIONS}


def add_options(parser, options: Sequence[Option]) -> None:
    for option in options:
        option.add_to(parser)


def given(args: argparse.Namespace, options: Sequence[Option],
          environ: Mapping[str, str] | None = None, with_defaults: bool = True) -> dict[str, Any]:
    """{dest: value} of the options set on the command line or, failing that, through
    their environment variable, or failing that (`with_defaults`), with a default of their
    own. Raises argparse.ArgumentTypeError naming the variable when its value does not
    parse."""
    out = {}
    for o in options:
        value = getattr(args, o.dest, None)
        if value is None and environ is not None and o.env and environ.get(o.env, "") != "":
            value = _from_env(o, environ[o.env])
        if value is None and with_defaults:
            value = o.default
        if value is not None:  # None: not given, or "auto": the config decides
            out[o.dest] = value
    return out


def _from_env(o: Option, text: str):
    try:
        if o.parse is None:
            return on_off_auto(text)
        return o.parse(text)
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"{o.env}={text!r} ({o.flag}): {err}") from None


def to_argv(values: Mapping[str, Any], options: Sequence[Option]) -> list[str]:
    """Flags that give `values` ({dest: value}) back when parsed."""
    by_dest = {o.dest: o for o in options}
    return [a for dest, v in values.items() for a in by_dest[dest].argv(v)]


def config_error_message(message: str, options: Sequence[Option] = ENGINE_OPTIONS) -> str:
    """An EngineConfig error ("max_loras=0: must be >= 1") in the user's terms: the flag
    replaces the field name."""
    for o in sorted(options, key=lambda o: -len(o.dest)):
        if message.startswith(o.dest + "=") or message.startswith(o.dest + " "):
            return o.flag + message[len(o.dest):]
    return message
