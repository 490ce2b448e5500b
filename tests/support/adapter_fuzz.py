"""A corpus of hostile adapter directories and adapter paths, each with the gRPC status
the service must answer with.

`write_corpus(root, good, outside)` copies the valid PEFT adapter `good` (made by
tests/support/tiny.py) into hundreds of broken variants under `root`: bad JSON, wrong
types, huge/negative ranks, shape mismatches, wrong dtypes, truncated and lying
safetensors headers, NaN/Inf/overflowing weights, hostile regexes, links, FIFOs, sockets
and devices in place of files, huge (sparse) files. `path_attacks(root, outside)` gives
paths that try to leave the roots. Files outside the roots that attacks point at carry
CANARY in their path, so a test can look for it in what the service opened.

Codes: INVALID_ARGUMENT for anything malformed; PERMISSION_DENIED for a path that leaves
the roots or crosses a link (the directory or a component of it). A link in place of a
file inside a real adapter directory is a malformed adapter (INVALID_ARGUMENT): the
directory itself is inside the roots and nothing beyond the link is read.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
CANARY = "canary-3f9e1c"
INVALID, DENIED = "INVALID_ARGUMENT", "PERMISSION_DENIED"
PREFIX = "base_model.model.model.layers"
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@dataclass(frozen=True)
class Case:
    name: str        # adapter name to register under (unique)
    path: str        # as sent in LoadAdapter (relative to the first root, or absolute)
    code: str        # expected grpc.StatusCode name
    what: str        # what is broken, for failure messages


def key(layer: int, module: str, factor: str) -> str:
    return f"{PREFIX}.{layer}.{MODULES[module]}.{module}.lora_{factor}.weight"


def st_bytes(header: dict, data: bytes) -> bytes:
    """A safetensors file with exactly this header (lies included)."""
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


class _Writer:
    def __init__(self, root: Path, good: Path):
        self.root, self.good = root, good
        self.config = json.loads((good / CONFIG).read_text())
        self.tensors = load_file(good / WEIGHTS)
        self.weights = (good / WEIGHTS).read_bytes()
        self.cases: list[Case] = []

    def new(self, what: str, code: str = INVALID) -> Path:
        name = f"f{len(self.cases):03d}"
        d = self.root / name
        d.mkdir(parents=True)
        self.cases.append(Case(name, name, code, what))
        return d

    def with_config(self, what: str, text: str | bytes, code: str = INVALID) -> None:
        d = self.new(what, code)
        data = text.encode() if isinstance(text, str) else text
        (d / CONFIG).write_bytes(data)
        (d / WEIGHTS).write_bytes(self.weights)

    def config_with(self, what: str, code: str = INVALID, **changes) -> None:
        cfg = {**self.config, **changes}
        self.with_config(what, json.dumps(cfg), code)

    def with_weights(self, what: str, data: bytes, code: str = INVALID, config=None) -> None:
        d = self.new(what, code)
        (d / CONFIG).write_text(json.dumps(config or self.config))
        (d / WEIGHTS).write_bytes(data)

    def tensors_with(self, what: str, fn, code: str = INVALID, config=None) -> None:
        tensors = {k: v.clone() for k, v in self.tensors.items()}
        fn(tensors)
        d = self.new(what, code)
        (d / CONFIG).write_text(json.dumps(config or self.config))
        save_file(tensors, d / WEIGHTS, metadata={"format": "pt"})


def write_corpus(root: Path, good: Path, outside: Path) -> list[Case]:
    """Write the malformed adapter directories under `root`; returns their cases."""
    w = _Writer(root, good)
    _bad_json(w)
    _wrong_types(w)
    _ranks_and_flags(w)
    _hostile_regexes(w)
    _tensor_shapes_and_names(w)
    _dtypes(w)
    _safetensors_lies(w)
    _values(w)
    _special_files(w, outside)
    return w.cases


def _bad_json(w: _Writer) -> None:
    text = json.dumps(w.config)
    for cut in (0, 1, 2, 5, 10, 20, len(text) // 3, len(text) // 2, len(text) - 2, len(text) - 1):
        w.with_config(f"config truncated at {cut}", text[:cut])
    for what, raw in [("array", "[]"), ("null", "null"), ("number", "42"), ("string", '"x"'),
                      ("true", "true"), ("garbage", "{not json"), ("trailing", text + "}"),
                      ("nesting", "[" * 100000), ("object nesting", '{"a":' * 50000 + "1"),
                      ("latin-1", text.encode().replace(b'"r"', b'"\xe9"')),
                      ("NUL bytes", b"\0" * 64), ("utf-16", text.encode("utf-16")),
                      ("huge int", text[:-1] + ', "x": ' + "9" * 5000 + "}"),
                      ("comment", "// c\n" + text), ("single quotes", text.replace('"', "'"))]:
        w.with_config(f"config is {what}", raw)
    w.with_config("config 2 MiB of spaces (over the size limit)", " " * (2 << 20) + text)


def _wrong_types(w: _Writer) -> None:
    bad = {
        "r": ["8", 8.5, -1, 0, True, [8], {}, None, 2 ** 64, 10 ** 9, 65, 1e3],
        "lora_alpha": ["16", None, [16], True, {}, 1e999],
        "target_modules": [5, [5], {}, True, [], "", ["q_proj", 3], [None], "lm_head",
                           ["embed_tokens"], ["lm_head"], ["nope"], "zzz", ["q_proj", "nope"]],
        "exclude_modules": [5, [5], {"a": 1}, True, 1.5],
        "rank_pattern": ["q_proj", [1], {"q_proj": -1}, {"q_proj": "4"}, {"q_proj": 1000},
                         {"q_proj": 4.5}, {"q_proj": 0}, {"q_proj": None}, 7],
        "alpha_pattern": ["q_proj", [1], {"q_proj": "x"}, {"q_proj": None}, {"q_proj": [1]},
                          {"q_proj": 1e999}, 3],
        "layers_to_transform": ["0", [0.5], [99], 99, [-1], [True], {"a": 0}, [[0]]],
        "peft_type": ["LOHA", 5, None, "IA3", ["LORA"]],
        "bias": ["all", "lora_only", 5],
    }
    for field, values in bad.items():
        for v in values:
            w.config_with(f"{field}={v!r:.40}", **{field: v})
    w.config_with("layers_pattern without 'layers'", layers_to_transform=[0],
                  layers_pattern="blocks")
    for lit in ("NaN", "Infinity", "-Infinity"):
        text = json.dumps({**w.config, "lora_alpha": 0}).replace('"lora_alpha": 0',
                                                                  f'"lora_alpha": {lit}')
        w.with_config(f"lora_alpha={lit}", text)
    w.config_with("2000 rank_pattern keys", rank_pattern={f"k{i}": 4 for i in range(2000)})


def _ranks_and_flags(w: _Writer) -> None:
    for r in (4, 16, 2, 1):  # config rank other than the tensors' 8
        w.config_with(f"r={r} but tensors of rank 8", r=r)
    w.config_with("rank_pattern gives q_proj rank 4, tensors have 8", rank_pattern={"q_proj": 4})
    for flag, value in [("use_dora", True), ("lora_bias", True), ("modules_to_save", ["lm_head"]),
                        ("fan_in_fan_out", True), ("init_lora_weights", "pissa"),
                        ("init_lora_weights", "olora"), ("init_lora_weights", "loftq"),
                        ("layer_replication", [[0, 1]]), ("use_qalora", True),
                        ("target_parameters", ["x.weight"]), ("trainable_token_indices", [1]),
                        ("alora_invocation_tokens", [1])]:
        w.config_with(f"{flag}={value!r}", **{flag: value})


HOSTILE = [r"(a+)+$", r"(.*a){25}", r"(x+x+)+y", r"(\w|\w\w)*\d", r"((a|aa)+)+b",
           r"(.*\.)*(.*\.)*(.*\.)*(.*\.)*z", r"(?:[a-z_.0-9]+)+!", r"(m|mo|mod|mode|model)+\.#"]
NOT_RE2 = [r"(q)\1_proj", r"(?=q)q_proj", r"(?<=\.)q_proj", r"(?!x)q_proj", r"(a{1000}){1000}",
           r"(?P<x>q)(?P=x)", r"q_proj(?#c)\Z"]


def _hostile_regexes(w: _Writer) -> None:
    for p in HOSTILE:  # catastrophic for backtracking, matching no module: refused quickly
        w.config_with(f"target_modules={p!r}", target_modules=p)
        w.config_with(f"exclude_modules={p!r} + no target", target_modules=["nope"],
                      exclude_modules=p)
        w.config_with(f"rank_pattern {p!r} + no target", target_modules=["nope"],
                      rank_pattern={p: 4})
        w.config_with(f"alpha_pattern {p!r} + no target", target_modules=["nope"],
                      alpha_pattern={p: 4})
    for p in NOT_RE2:
        for field in ("target_modules", "exclude_modules"):
            w.config_with(f"{field}={p!r} (no linear-time engine)", **{field: p})
        w.config_with(f"rank_pattern key {p!r}", rank_pattern={p: 4})
    w.config_with("target_modules regex of 20000 chars", target_modules="q" * 20000)
    w.config_with("invalid regex", target_modules="(unclosed")


def _tensor_shapes_and_names(w: _Writer) -> None:
    for module in MODULES:
        for factor in "AB":
            k = key(0, module, factor)
            w.tensors_with(f"{k} transposed", lambda t, k=k: t.__setitem__(k, t[k].t().contiguous()))
            w.tensors_with(f"{k} one column short",
                           lambda t, k=k: t.__setitem__(k, t[k][:, :-1].contiguous()))
            w.tensors_with(f"{k} missing", lambda t, k=k: t.pop(k))
        k = key(1, module, "A")
        w.tensors_with(f"{k} 3-d", lambda t, k=k: t.__setitem__(k, t[k][None].contiguous()))
        w.tensors_with(f"{k} 1-d", lambda t, k=k: t.__setitem__(k, t[k].flatten().contiguous()))
    extra = {
        "layer beyond the model": f"{PREFIX}.7.self_attn.q_proj.lora_A.weight",
        "unknown module": f"{PREFIX}.0.self_attn.r_proj.lora_A.weight",
        "wrong parent": f"{PREFIX}.0.mlp.q_proj.lora_A.weight",
        "embedding": "base_model.model.model.embed_tokens.lora_embedding_A",
        "lm_head": "base_model.model.lm_head.lora_A.weight",
        "dora magnitude": f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector",
        "lora bias": f"{PREFIX}.0.self_attn.q_proj.lora_B.bias",
        "base bias": f"{PREFIX}.0.self_attn.q_proj.bias",
        "modules_to_save": "base_model.model.lm_head.modules_to_save.weight",
        "duplicate lora_A": f"{PREFIX}.0.self_attn.q_proj.lora_A.default.weight",
        "not lora at all": "hello",
        "empty name": "",
    }
    for what, k in extra.items():
        w.tensors_with(f"extra tensor: {what}", lambda t, k=k: t.__setitem__(k, torch.zeros(8, 64)))
    w.tensors_with("no tensors", lambda t: t.clear())
    w.tensors_with("untargeted module's tensors", lambda t: None,
                   config={**w.config, "target_modules": ["q_proj"]})


def _dtypes(w: _Writer) -> None:
    for module in ("q_proj", "down_proj", "v_proj"):
        for factor in "AB":
            k = key(0, module, factor)
            for dtype in (torch.int32, torch.int64, torch.uint8, torch.bool, torch.int16,
                          torch.int8):
                w.tensors_with(f"{k} as {dtype}", lambda t, k=k, d=dtype: t.__setitem__(
                    k, (t[k] * 10).to(d)))


def _safetensors_lies(w: _Writer) -> None:
    data = w.weights
    n = int.from_bytes(data[:8], "little")
    for cut in (0, 1, 4, 7, 8, 9, 8 + n // 2, 8 + n, 8 + n + 1, len(data) // 2, len(data) - 1):
        w.with_weights(f"safetensors truncated at {cut}", data[:cut])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    # the tensor stored last: moving its offsets anywhere is a lie
    some = max((k for k in header if k != "__metadata__"),
               key=lambda k: header[k]["data_offsets"][0])

    def lie(what, fn, body=body):
        h = json.loads(json.dumps(header))
        fn(h)
        w.with_weights(f"header lies: {what}", st_bytes(h, body))
    lie("offsets past the end", lambda h: h[some].__setitem__(
        "data_offsets", [h[some]["data_offsets"][0], len(body) + 4096]))
    lie("begin > end", lambda h: h[some].__setitem__("data_offsets", [64, 0]))
    lie("overlap", lambda h: h[some].__setitem__("data_offsets", [0, h[some]["data_offsets"][1]
                                                                  - h[some]["data_offsets"][0]]))
    lie("shape bigger than its bytes", lambda h: h[some].__setitem__("shape", [8, 6400]))
    lie("negative shape", lambda h: h[some].__setitem__("shape", [-8, 64]))
    lie("float shape", lambda h: h[some].__setitem__("shape", [8.0, 64]))
    lie("huge shape", lambda h: h[some].__setitem__("shape", [2 ** 62, 2 ** 62]))
    lie("unknown dtype", lambda h: h[some].__setitem__("dtype", "F128"))
    lie("dtype not a string", lambda h: h[some].__setitem__("dtype", 4))
    lie("entry not an object", lambda h: h.__setitem__(some, [1, 2]))
    lie("extra entry field", lambda h: h[some].__setitem__("evil", 1))
    lie("metadata not strings", lambda h: h.__setitem__("__metadata__", {"a": [1]}))
    lie("missing offsets", lambda h: h[some].pop("data_offsets"))
    lie("bytes left over", lambda h: None, body=body + b"\0" * 16)
    lie("gap at the start", lambda h: None, body=b"\0" * 4 + body)
    w.with_weights("header length 2^63", struct.pack("<Q", 1 << 63) + data[8:])
    w.with_weights("header length 100 MiB", struct.pack("<Q", 100 << 20) + data[8:])
    w.with_weights("header not JSON", struct.pack("<Q", 4) + b"\xff\xfe{[" + body)
    w.with_weights("header deep nesting", st_bytes({}, b"")[:0] + struct.pack("<Q", 60000)
                   + b"[" * 60000)
    w.with_weights("header is a list", st_bytes([], b""))  # type: ignore[arg-type]
    w.with_weights("pickle bytes", b"\x80\x04\x95" + b"\0" * 64)
    w.with_weights("empty", b"")


def _values(w: _Writer) -> None:
    for module in MODULES:
        for factor, layer in (("A", 0), ("B", 1)):
            k = key(layer, module, factor)
            w.tensors_with(f"NaN in {k}", lambda t, k=k: t[k].view(-1).__setitem__(3, float("nan")))
            w.tensors_with(f"+inf in {k}", lambda t, k=k: t[k].view(-1).__setitem__(0, float("inf")))
        k = key(0, module, "B")
        w.tensors_with(f"-inf in {k}", lambda t, k=k: t[k].view(-1).__setitem__(-1, float("-inf")))
        w.tensors_with(f"1e30 in {k}", lambda t, k=k: t[k].view(-1).__setitem__(5, 1e30))
        w.tensors_with(f"F64 1e300 in {k} (inf once cast)", lambda t, k=k: (
            t.__setitem__(k, t[k].double()), t[k].view(-1).__setitem__(2, 1e300)))
        w.tensors_with(f"F16 max in {k}, times scaling", lambda t, k=k: (
            t.__setitem__(k, t[k].half()), t[k].view(-1).__setitem__(1, 65504.0)))
    for alpha in (1e30, 1e38, 3e38, 1e6, 1e7):
        w.config_with(f"lora_alpha={alpha:g} (B times scaling explodes)", lora_alpha=alpha)
    w.config_with("alpha_pattern 1e35 on down_proj", alpha_pattern={"down_proj": 1e35})
    w.config_with("rslora with alpha 1e36", use_rslora=True, lora_alpha=1e36)
    w.tensors_with("all NaN", lambda t: [v.fill_(float("nan")) for v in t.values()])


def _special_files(w: _Writer, outside: Path) -> None:
    can_mknod = _can_mknod(w.root)
    for name in (CONFIG, WEIGHTS):
        other = WEIGHTS if name == CONFIG else CONFIG
        src = (w.good / other).read_bytes()

        def make(what, create):
            d = w.new(f"{name} is {what}")
            (d / other).write_bytes(src)
            create(d / name)
        make("a link outside", lambda p: os.symlink(outside / CANARY / name, p))
        make("a link to /etc/passwd", lambda p: os.symlink("/etc/passwd", p))
        make("a link inside", lambda p: os.symlink(w.good / name, p))
        make("a relative link", lambda p: os.symlink(f"../../{outside.name}/{CANARY}/{name}", p))
        make("a dangling link", lambda p: os.symlink("/nonexistent/" + CANARY, p))
        make("a link to itself", lambda p: os.symlink(p.name, p))
        make("a FIFO", lambda p: os.mkfifo(p))
        make("a socket", _bind_socket)
        make("a directory", lambda p: p.mkdir())
        make("empty", lambda p: p.write_bytes(b""))
        make("a link to /dev/zero", lambda p: os.symlink("/dev/zero", p))
        if can_mknod:
            make("a character device (/dev/zero's numbers)",
                 lambda p: os.mknod(p, 0o600 | 0o020000, os.makedev(1, 5)))
            make("a block device", lambda p: os.mknod(p, 0o600 | 0o060000, os.makedev(7, 0)))
        make("sparse and huge", lambda p: _sparse(p, 20 << 30))
    d = w.new("only a pickle file")
    shutil.copy(w.good / CONFIG, d / CONFIG)
    (d / "adapter_model.bin").write_bytes(b"\x80\x04never unpickled")
    w.new("empty directory")
    d = w.new("weights 8 GiB (sparse)")
    shutil.copy(w.good / CONFIG, d / CONFIG)
    _sparse(d / WEIGHTS, 1 << 33)


def _bind_socket(p: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(p))
    s.close()  # the socket file stays


def _sparse(p: Path, size: int) -> None:
    with open(p, "wb") as f:
        f.truncate(size)


def _can_mknod(root: Path) -> bool:
    probe = root / ".mknod-probe"
    try:
        os.mknod(probe, 0o600 | 0o020000, os.makedev(1, 5))
    except (PermissionError, OSError):
        return False
    probe.unlink()
    return True


def path_attacks(root: Path, outside: Path, good_name: str) -> list[Case]:
    """Adapter paths that try to leave `root` (the only root); `good_name` is a valid
    adapter directory inside it. Creates the links they need."""
    canary = outside / CANARY
    sibling = root.parent / (root.name + "-evil")
    shutil.copytree(canary, sibling / "x", dirs_exist_ok=True)
    links = {
        "l-out": canary, "l-in": root / good_name, "l-root": root, "l-slash": Path("/"),
        "l-rel-out": Path(f"../{outside.name}/{CANARY}"), "l-chain": root / "l-out",
        "l-dangling": Path("/nonexistent"), "l-etc": Path("/etc"), "l-self": root / "l-self",
    }
    for name, target in links.items():
        os.symlink(target, root / name)
    (root / "real").mkdir()
    os.symlink(canary, root / "real" / "l-deep")
    os.symlink(root / good_name, root / "real" / "l-deep-in")
    denied = [
        str(canary), str(outside), "/etc", "/", "/tmp", "/proc/self/root" + str(canary),
        "/proc/self/cwd", "/dev/null", str(canary) + "/", str(sibling / "x"), str(sibling),
        str(root) + "-evil/x", f"{root}/../{outside.name}/{CANARY}", f"../{outside.name}/{CANARY}",
        "..", "../", f"{good_name}/../..", f"{good_name}/../../{outside.name}/{CANARY}",
        "./..", "real/../..", "a/b/../../..", f"{root}/..", str(root), ".", "./", "",
        "/nonexistent/" + CANARY, "//etc", "/../etc", str(canary / CONFIG),
        "l-out", "l-in", "l-root", "l-slash", "l-rel-out", "l-chain", "l-dangling", "l-etc",
        "l-self", "l-out/", "real/l-deep", "real/l-deep-in", f"{root}/l-out", f"{root}/l-in",
        "l-slash/etc", "l-root/" + good_name, "l-etc/passwd", "real/l-deep/x",
        "bad\0name", f"{good_name}\0/../..",
    ]
    invalid = [
        "nope", "real", f"{good_name}/{CONFIG}", "~", "~/x", "..%2f..%2fetc", "....", "x" * 300,
        "/".join(["d"] * 600), f"{good_name}/missing", "real/missing/deeper", " ",
        f"{good_name}\n",
    ]
    cases = [Case(f"p{i:03d}", p, DENIED, f"path {p[:80]!r}") for i, p in enumerate(denied)]
    cases += [Case(f"p{len(denied) + i:03d}", p, INVALID, f"path {p[:80]!r}")
              for i, p in enumerate(invalid)]
    return cases
