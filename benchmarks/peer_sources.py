"""The peers' LoRA kernel sources, from their published wheels, for benchmarks/bench_peers.py:

    python -m benchmarks.peer_sources fetch [--dest DIR] [pip options]

On a machine that reaches the package index: `pip download --no-deps` each pinned wheel
(PEERS) into a temporary folder, then extract only the files the benchmark loads into
DIR/<name>-<version>/ (default benchmarks/.peers, which git ignores) with a manifest.json:
wheel file name, version, the wheel's sha256, and each extracted file's sha256. The tree
is small (a few hundred kB): carry it to the GPU machine as it is; `find` checks it
there against its manifest. Nothing of the peers' code is part of this repository.

Pins: vLLM 0.33.0 (vllm/lora/ops/triton_ops: lora_shrink, lora_expand and the metadata
their wrapper builds) and SGLang 0.5.23, whose chunked SGMV kernels (the "csgmv" backend,
its default) moved from sglang/srt/lora/triton_ops/ to sglang/kernels/ops/lora/dense/,
with their tuned launch configurations beside them. Both need only triton and torch once
the few helpers they import are stood in for (benchmarks/peer_shims.py).
"""
from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DIR = Path(__file__).resolve().parent / ".peers"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class PeerSpec:
    """One peer: the pinned wheel, the files taken from it (globs inside the wheel) and the
    modules loaded from them, in import order (each a file of `files`)."""
    name: str
    version: str
    files: tuple[str, ...]
    modules: tuple[str, ...]

    @property
    def folder(self) -> str:
        return f"{self.name}-{self.version}"


_VLLM_OPS = "vllm/lora/ops/triton_ops"
_SGLANG_OPS = "sglang/kernels/ops/lora/dense"

PEERS: dict[str, PeerSpec] = {
    "vllm": PeerSpec(
        "vllm", "0.33.0",
        files=tuple(f"{_VLLM_OPS}/{f}.py" for f in (
            "kernel_utils", "utils", "lora_kernel_metadata", "lora_shrink_op",
            "lora_expand_op")),
        modules=tuple(f"vllm.lora.ops.triton_ops.{m}" for m in (
            "kernel_utils", "utils", "lora_kernel_metadata", "lora_shrink_op",
            "lora_expand_op"))),
    "sglang": PeerSpec(
        "sglang", "0.5.23",
        files=(f"{_SGLANG_OPS}/lora_tuning_config.py", f"{_SGLANG_OPS}/chunked_sgmv_shrink.py",
               f"{_SGLANG_OPS}/chunked_sgmv_expand.py", f"{_SGLANG_OPS}/csgmv_configs/*/*.json"),
        modules=tuple(f"sglang.kernels.ops.lora.dense.{m}" for m in (
            "lora_tuning_config", "chunked_sgmv_shrink", "chunked_sgmv_expand"))),
}


class PeerMissing(Exception):
    """A peer's extracted tree is absent or does not match its manifest."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def extract(wheel: Path, spec: PeerSpec, dest: Path) -> Path:
    """Extract `spec`'s files from `wheel` into dest/<name>-<version>/ (replaced if there)
    with its manifest; returns that folder. ValueError when the wheel is not the pinned
    version or lacks a file the spec names."""
    prefix = f"{spec.name}-{spec.version}-"
    if not wheel.name.startswith(prefix) or not wheel.name.endswith(".whl"):
        raise ValueError(f"{wheel.name} is not a {spec.name} {spec.version} wheel")
    out = dest / spec.folder
    files: dict[str, str] = {}
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if not n.endswith("/")]
        for pattern in spec.files:
            hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise ValueError(f"{wheel.name} has no file {pattern}")
            for name in hits:
                if name.startswith("/") or ".." in Path(name).parts:
                    raise ValueError(f"{wheel.name}: unsafe member name {name!r}")
                data = zf.read(name)
                files[name] = hashlib.sha256(data).hexdigest()
                target = out / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
    manifest = {"name": spec.name, "version": spec.version, "wheel": wheel.name,
                "sha256": sha256(wheel), "files": files}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return out


def find(spec: PeerSpec, root: Path = DEFAULT_DIR) -> dict:
    """The manifest of `spec`'s extracted tree under `root`, checked file by file;
    PeerMissing saying what is wrong otherwise."""
    folder = root / spec.folder
    path = folder / MANIFEST
    if not path.is_file():
        raise PeerMissing(f"{spec.name} {spec.version}: no {path}")
    manifest = json.loads(path.read_text())
    if (manifest.get("name"), manifest.get("version")) != (spec.name, spec.version):
        raise PeerMissing(f"{path} describes {manifest.get('name')} "
                          f"{manifest.get('version')}, not {spec.name} {spec.version}")
    for name, digest in manifest["files"].items():
        f = folder / name
        if not f.is_file() or sha256(f) != digest:
            raise PeerMissing(f"{spec.name} {spec.version}: {f} is missing or changed")
    return manifest


def fetch_hint(root: Path = DEFAULT_DIR) -> str:
    """What to run, and where, to get the peers' sources."""
    return (f"on a machine with the package index: python -m benchmarks.peer_sources fetch "
            f"--dest {root}; then carry that folder here (a few hundred kB)")


def download(spec: PeerSpec, into: Path, pip_args: tuple[str, ...] = ()) -> Path:
    """`pip download --no-deps` the pinned wheel into `into`; returns its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--quiet", "-d", str(into), *pip_args, f"{spec.name}=={spec.version}"]
    subprocess.run(cmd, check=True)
    wheels = sorted(into.glob(f"{spec.name}-{spec.version}-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download left no {spec.name} {spec.version} wheel in {into}")
    return wheels[0]


def fetch(dest: Path = DEFAULT_DIR, pip_args: tuple[str, ...] = (),
          names: tuple[str, ...] = tuple(PEERS)) -> list[Path]:
    """Download and extract each named peer into `dest`; the wheels go with the temporary
    folder. Returns the extracted folders."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            spec = PEERS[name]
            wheel = download(spec, Path(tmp), pip_args)
            out.append(extract(wheel, spec, dest))
            wheel.unlink()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["fetch", "check"])
    p.add_argument("--dest", type=Path, default=DEFAULT_DIR)
    p.add_argument("--peer", action="append", choices=list(PEERS),
                   help="only this peer (repeatable; default: all)")
    args, pip_args = p.parse_known_args(argv)
    names = tuple(args.peer or PEERS)
    if args.command == "fetch":
        for folder in fetch(args.dest, tuple(pip_args), names):
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            print(f"{folder}: {size / 1e3:.0f} kB")
        return 0
    rc = 0
    for name in names:
        try:
            m = find(PEERS[name], args.dest)
            print(f"{name} {m['version']}: {m['wheel']} sha256 {m['sha256'][:16]}... "
                  f"{len(m['files'])} files ok")
        except PeerMissing as e:
            print(f"{e}\n  {fetch_hint(args.dest)}", file=sys.stderr)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
