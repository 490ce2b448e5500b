"""Packaging: the server and client packages declare every third-party module their code
imports and nothing they do not import; the floors of grpcio and protobuf are the versions
the committed generated code was made with; generators and test tools stay in extras."""
from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
# import names whose distribution is not found by packages_distributions()
KNOWN = {"loramux": "loramux-client", "tomli": "tomli", "google.protobuf": "protobuf",
         "google.rpc": "googleapis-common-protos"}
TOOLS = {"pytest", "pytest-timeout", "transformers", "peft", "openai", "matplotlib",
         "grpcio-tools", "hypothesis"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _project(path: Path) -> dict:
    return tomllib.loads(path.read_text())["project"]


def _requirements(project: dict, extra: str | None = None) -> dict[str, str]:
    """{normalized distribution name: requirement}"""
    reqs = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return {_norm(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]): r for r in reqs}


def _imports(roots: list[Path], own: set[str]) -> set[str]:
    """Modules from other distributions imported by the code under `roots` (the package's
    own top-level modules `own` and the standard library aside; "google.x" two-level)."""
    out = set()
    for root in roots:
        for path in root.rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    parts = name.split(".")
                    top = ".".join(parts[:2]) if parts[0] == "google" else parts[0]
                    if parts[0] not in own and parts[0] not in sys.stdlib_module_names \
                            and parts[0] != "__future__":
                        out.add(top)
    return out


def _distributions(imports: set[str]) -> set[str]:
    found = md.packages_distributions()
    out = set()
    for name in imports:
        dist = KNOWN.get(name) or (found.get(name) or [None])[0]
        assert dist is not None, f"no installed distribution provides {name!r}"
        out.add(_norm(dist))
    return out


@pytest.mark.parametrize("package,roots,own", [
    ("pyproject.toml", ["engine", "kernels", "loramux_core", "services"],
     {"loramux_engine", "loramux_kernels", "loramux_core", "loramux_services"}),
    ("clients/python/pyproject.toml", ["clients/python/loramux"], {"loramux"}),
])
def test_runtime_imports_are_declared_and_declarations_used(package, roots, own):
    """(The client's `loramux serve` runs the server package's launcher by its module
    name, without importing it.)"""
    declared = set(_requirements(_project(REPO / package)))
    used = _distributions(_imports([REPO / r for r in roots], own))
    assert used - declared == set(), f"{package}: imported but not declared"
    assert declared - used == set(), f"{package}: declared but never imported"
    assert not declared & TOOLS, f"{package}: generators and test tools belong in extras"


def _floor(requirement: str) -> tuple[int, ...]:
    m = re.search(r">=\s*([\d.]+)", requirement)
    assert m, f"{requirement!r} has no version floor"
    return tuple(int(x) for x in m.group(1).split("."))


def test_floors_match_the_generated_code():
    gen = REPO / "clients/python/loramux/v1"
    grpc_made = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'",
                          (gen / "generate_pb2_grpc.py").read_text()).group(1)
    m = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", (gen / "generate_pb2.py").read_text())
    protobuf_made = tuple(int(x) for x in m.groups())
    for package in ("pyproject.toml", "clients/python/pyproject.toml"):
        reqs = _requirements(_project(REPO / package))
        assert _floor(reqs["grpcio"]) >= tuple(int(x) for x in grpc_made.split(".")), package
        assert _floor(reqs["protobuf"]) >= protobuf_made, package
    tools = _requirements(_project(REPO / "pyproject.toml"), "dev")["grpcio-tools"]
    assert tools.endswith(f"=={grpc_made}"), "the generator must be the one that made the code"


def test_every_requirement_has_a_floor():
    for package in ("pyproject.toml", "clients/python/pyproject.toml"):
        project = _project(REPO / package)
        for extra in [None, *project.get("optional-dependencies", {})]:
            for req in _requirements(project, extra).values():
                assert re.search(r"(>=|==)\s*\d", req), f"{package}: {req!r} has no version floor"


@pytest.mark.parametrize("package", ["pyproject.toml", "clients/python/pyproject.toml"])
def test_metadata_is_written_the_way_setuptools_keeps_supporting(package):
    """An SPDX `license` string instead of the table deprecated in setuptools 77, and a
    build backend floor that reads it (tests/test_wheels.py builds both wheels and checks
    that the build prints no deprecation warning)."""
    source = REPO / package
    assert isinstance(_project(source)["license"], str), "license as an SPDX string"
    with open(source, "rb") as f:
        requires = tomllib.load(f)["build-system"]["requires"]
    assert _floor(next(r for r in requires if r.startswith("setuptools"))) >= (77,)
