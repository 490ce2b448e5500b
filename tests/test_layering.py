"""The folders are the layers, and every import arrow points down (docs/ARCHITECTURE.md):

    services/, engine/  ──▶  loramux_core/  ──▶  loramux.v1 (the public protos, in the SDK)
    engine/  ──▶  kernels/  ──▶  torch, triton
    clients/python (the SDK and CLI)  ──▶  itself only

- the processes that only route or administer (gateway, control plane) and the SDK with
  its command line load neither torch, nor triton, nor any engine module when imported,
  and the running gateway and control plane map no torch;
- kernels import nothing of loramux; loramux_core only the public protos; the SDK nothing
  of the server; the engine nothing of services or the SDK but the public protos;
- services import the engine only where ENGINE_CROSSINGS says, each with its reason.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SDK = ROOT / "clients" / "python"

# (file, engine module imported there): why the service still needs the engine's own code.
# An entry must import lazily (inside a function), so importing the service loads no engine.
# None is left: what the gateway and the control plane read of the model and the adapters
# (the model registry, the HF config reader, the adapter plan) is torch-free and lives in
# loramux_core/, and `loramux serve` checks loramux_core's EngineSettings.
ENGINE_CROSSINGS: dict[tuple[str, str], str] = {}

# layer (a folder) -> import roots it must not use; the SDK's root is `loramux`, its
# public protos `loramux.v1` are the one part of it others may import.
FORBIDDEN = {
    "kernels": ("loramux_engine", "loramux_services", "loramux", "loramux_core"),
    "loramux_core": ("loramux_engine", "loramux_services", "loramux_kernels", "loramux"),
    "clients/python/loramux": ("loramux_engine", "loramux_services", "loramux_kernels",
                               "loramux_core"),
    "engine": ("loramux_services", "loramux"),
    "services": ("loramux_engine", "loramux_kernels"),
}
# The public protos, generated into the SDK (scripts/gen_protos.sh): the one part of the
# SDK that the engine and the contract may import.
PUBLIC_PROTOS = ("generate", "adapter_admin")
ALLOWED = tuple(f"loramux.v1.{p}_pb2{grpc}" for p in PUBLIC_PROTOS for grpc in ("", "_grpc"))


def imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, absolute module, at module level) for every import statement in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # each name as its full path: `from loramux.v1 import engine_pb2` is
            # loramux.v1.engine_pb2, which a check of the module alone would let pass
            found += [(node.lineno, f"{node.module}.{a.name}", id(node) in top)
                      for a in node.names]
    return found


def _under(module: str, root: str) -> bool:
    return module == root or module.startswith(root + ".")


def violations(layer: str, roots=ROOT) -> list[str]:
    bad = []
    for path in sorted((roots / layer).rglob("*.py")):
        rel = path.relative_to(roots).as_posix()
        for line, module, module_level in imports(path):
            hits = [r for r in FORBIDDEN[layer] if _under(module, r)
                    and not any(_under(module, a) for a in ALLOWED)]
            if not hits:
                continue
            crossing = (rel, ".".join(module.split(".")[:3]))
            if layer == "services" and not module_level and (
                    crossing in ENGINE_CROSSINGS or (rel, ".".join(module.split(".")[:2]))
                    in ENGINE_CROSSINGS):
                continue
            bad.append(f"{rel}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_imports_point_down(layer):
    assert violations(layer) == []


def test_every_listed_crossing_still_exists():
    """A crossing that is gone leaves the list, so the list only shrinks."""
    seen = set()
    for path in (ROOT / "services").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for _, module, _ in imports(path):
            seen |= {(rel, ".".join(module.split(".")[:n])) for n in (2, 3)}
    assert set(ENGINE_CROSSINGS) <= seen, set(ENGINE_CROSSINGS) - seen


def test_the_check_sees_a_forbidden_import(tmp_path):
    """The layering check can fail: one planted import of each kind is reported."""
    planted = {
        "kernels/k.py": "from loramux_engine.model.batch import AttentionMetadata\n",
        "engine/e.py": "def f():\n    from loramux_services.serve import main\n",
        "services/s.py": "from loramux_engine.server.curve import ZmqKeys\n",
        "services/control/main.py": "def f():\n    import loramux_engine.lora.weights\n",  # lazy, unlisted
        "clients/python/loramux/c.py": "from loramux_core.v1 import engine_pb2\n",
        "loramux_core/x.py": "from loramux import client\n",
        "engine/p.py": "from loramux.v1 import engine_pb2, generate_pb2\n",
    }
    for rel, text in planted.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    reported = [v for layer in FORBIDDEN for v in violations(layer, tmp_path)]
    assert sorted(v.split(":")[0] for v in reported) == sorted(planted)


def test_the_sdk_ships_only_the_public_protos():
    assert {p.stem for p in (ROOT / "protos/loramux/v1").glob("*.proto")} == set(PUBLIC_PROTOS)
    generated = {p.name for p in (SDK / "loramux/v1").glob("*_pb2*.py")}
    assert generated == {m.removeprefix("loramux.v1.") + ".py" for m in ALLOWED}
    assert not list((SDK / "loramux").rglob("engine_pb2*"))
    assert (ROOT / "loramux_core/v1/engine_pb2.py").is_file()


# ---- what importing a process's code loads -------------------------------------------------

# import name -> the folder it lives in (pyproject's package-dir)
FOLDERS = {"loramux_engine": "engine", "loramux_kernels": "kernels",
           "loramux_services": "services"}


def _packages(*names: str) -> list[str]:
    """Every module of the given packages (loramux_services.gateway -> loramux_services.gateway.servicer, ...)."""
    found = []
    for name in names:
        top, _, rest = name.partition(".")
        base = ROOT / FOLDERS.get(top, top) / rest.replace(".", "/")
        found += [".".join((name, *p.relative_to(base).with_suffix("").parts))
                  .removesuffix(".__init__") for p in sorted(base.rglob("*.py"))
                  if p.name != "__main__.py"]
    return found


PROCESSES = {
    "gateway": _packages("loramux_services.gateway", "loramux_services.common"),
    "control plane": _packages("loramux_services.control", "loramux_services.common"),
    "SDK": ["loramux", "loramux.client", "loramux.aio", "loramux.tls", "loramux.v1.generate_pb2",
            "loramux.v1.generate_pb2_grpc", "loramux.v1.adapter_admin_pb2",
            "loramux.v1.adapter_admin_pb2_grpc"],
    "CLI": ["loramux.cli"],
    "contract": _packages("loramux_core"),
}
HEAVY = ("torch", "triton", "loramux_engine")
# a clean environment but for where the checkout's import names are (installed: nothing)
_ENV = {"PATH": "/usr/bin:/bin", **({"PYTHONPATH": os.environ["PYTHONPATH"]}
                                    if os.environ.get("PYTHONPATH") else {})}

_PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
if "loramux.cli" in sys.argv[1:]:
    sys.modules["loramux.cli"].build_parser().parse_args(["adapters", "list"])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})
print(json.dumps(heavy))
"""


@pytest.mark.parametrize("process", sorted(PROCESSES))
def test_importing_loads_no_torch_triton_or_engine(process):
    """A fresh interpreter imports every module of the process's code, then lists what of
    torch, triton and engine came with them: nothing."""
    modules = PROCESSES[process]
    assert modules
    out = subprocess.run([sys.executable, "-c", _PROBE.format(heavy=set(HEAVY)), *modules],
                         cwd=ROOT, env=_ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == [], f"{process} loads {json.loads(out.stdout)[:10]}"


def test_the_import_probe_sees_torch():
    """The probe can fail: importing the engine itself is reported."""
    out = subprocess.run([sys.executable, "-c", _PROBE.format(heavy=set(HEAVY)),
                          "loramux_engine.engine"], cwd=ROOT, env=_ENV, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert {"torch", "loramux_engine"} <= set(json.loads(out.stdout))


def _maps_torch(pid: int) -> bool:
    """Whether the process has torch's native library mapped."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps")
def test_running_services_map_no_torch(tmp_path):
    """At run time too: after the control plane has validated and loaded an adapter and
    the gateway has tokenized and streamed a call with it, neither process has torch's
    library mapped; the engine, the check's witness, has."""
    from loramux.client import AdminClient, GenerateClient

    from loramux_services.launcher import Cluster, ClusterConfig, wait_serving
    from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

    model = make_model(tmp_path / "model", TinySpec())
    make_adapter(tmp_path / "adapters" / "a1", model, AdapterSpec(seed=5))
    cfg = ClusterConfig(model=str(tmp_path / "model"), adapter_roots=(str(tmp_path / "adapters"),),
                        workdir=str(tmp_path / "run"), env={"OMP_NUM_THREADS": "1"})
    with Cluster(cfg) as cluster:
        cluster.start()
        cluster.wait_ready()
        wait_serving(cluster.gateway_address)
        with AdminClient(cluster.control_address) as admin:
            admin.register("a1", "a1")
            admin.load("a1", "a1")
        with GenerateClient(cluster.gateway_address) as gen:
            assert len(gen.generate("hello there", "a1", max_tokens=3, temperature=0.0)
                       .token_ids) == 3
        pids = {name: cluster.procs[name].pid for name in cluster.services}
        assert _maps_torch(pids[cluster.engine_names[0]])
        assert not _maps_torch(pids["control"])
        assert not _maps_torch(pids["gateway"])


# ---- no import circles ---------------------------------------------------------------------

CYCLE_FREE = ("engine", "services", "kernels", "loramux_core")


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _target(module: str, known: set[str]) -> str | None:
    """The module of ours that importing `module` runs: itself, or the nearest package
    above it that we have (`loramux_engine.lora.LoRASlotPool` -> loramux_engine.lora); None if not ours."""
    while module and module not in known:
        module = module.rpartition(".")[0]
    return module or None


def _edges(node: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Our modules an import statement runs, relative imports resolved: `from X import n`
    reaches X.n where that is a module of ours, and X itself for names that are not."""
    if isinstance(node, ast.Import):
        return {_target(a.name, known) for a in node.names} - {None}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:
        here = module.split(".") if is_package else module.split(".")[:-1]
        here = here[:len(here) - (node.level - 1)]
        base = ".".join(here + ([node.module] if node.module else []))
    subs = {f"{base}.{a.name}" for a in node.names} & known
    rest = {base} if len(subs) < len(node.names) else set()
    return {_target(n, known) for n in subs | rest} - {None}


def import_graph(root: Path = ROOT, packages=CYCLE_FREE) -> dict[str, set[str]]:
    """module -> modules of `packages` it imports, at module level or inside functions."""
    paths = {_module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    known = set(paths)
    graph = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), str(path))
        edges = set().union(*(_edges(node, module, path.name == "__init__.py", known)
                              for node in ast.walk(tree)))
        graph[module] = edges - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a -> ... -> a) per strongly connected group of modules, sorted."""
    order, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = set()
            while not group or w != v:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
            if len(group) > 1:
                found.append(_circle(graph, group))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return sorted(found)


def _circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest circle through the first module of a strongly connected group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def test_no_import_circles():
    """No module of engine/, services/, kernels/, loramux_core/ reaches itself through
    imports, counting those inside functions: each circle found is named."""
    found = cycles(import_graph())
    assert found == [], "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_circle_check_sees_a_circle(tmp_path):
    """The check can fail: a circle planted through a function-level relative import and
    a package's __init__ is reported, and modules beside it are not."""
    planted = {
        "engine/__init__.py": "",
        "engine/a.py": "from engine.pkg import b\n",
        "engine/pkg/__init__.py": "from .b import thing\n",
        "engine/pkg/b.py": "def f():\n    from ..c import g\nthing = 1\n",
        "engine/c.py": "import engine.a\n",
        "engine/d.py": "from engine.pkg import thing\nfrom engine import c\n",
    }
    for rel, text in planted.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path, ("engine",))
    assert graph["engine.d"] == {"engine.pkg", "engine.c"}
    assert cycles(graph) == [["engine.a", "engine.pkg.b", "engine.c", "engine.a"]]
