"""The wheels a user installs: every top-level name they install is loramux's own, the
server wheel carries every module of its folders under its import name, and both wheels
install into a fresh environment beside transformers, PEFT and Hugging Face's `kernels`
(the pinned versions) with no file owned twice, where a tiny transformers model runs and
`loramux serve` serves it the same tokens."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata, util
from pathlib import Path

import pytest

from tests.support.tiny import make_model

# the CPU suite checks packaging; a CUDA run's machine may lack the build backend's floor
pytestmark = pytest.mark.skipif(os.environ.get("LORAMUX_TEST_DEVICE", "cpu") != "cpu",
                                reason="packaging is checked by the CPU suite")
REPO = Path(__file__).resolve().parents[1]
# folder -> import name (pyproject's package-dir); loramux_core is its own folder
FOLDERS = {"engine": "loramux_engine", "kernels": "loramux_kernels",
           "services": "loramux_services", "loramux_core": "loramux_core"}
SOURCES = ("pyproject.toml", "README.md", *FOLDERS, "clients/python")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The two wheels, built from a copy of the sources (a build in the checkout would
    leave build/ behind, whose stale files a later build packs); and what the build said."""
    tmp = tmp_path_factory.mktemp("wheels")
    src = tmp / "src"
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns(
                "__pycache__", "*.egg-info", "build"))
        else:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / name, src / name)
    said = ""
    for project in (src, src / "clients/python"):
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
             "--no-index", "-v", "-w", str(tmp / "dist"), str(project)],
            capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        said += (proc.stdout + proc.stderr).replace(str(tmp), "TMP")
    wheels = {w.name.split("-")[0]: w for w in (tmp / "dist").glob("*.whl")}
    assert set(wheels) == {"loramux", "loramux_client"}, wheels
    return wheels, said


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def test_every_top_level_name_the_wheels_install_is_loramux(built):
    wheels, _ = built
    for wheel in wheels.values():
        tops = {n.split("/")[0] for n in _names(wheel)}
        tops = {t for t in tops if not t.endswith(".dist-info")}
        foreign = sorted(t for t in tops if not t.startswith("loramux"))
        assert tops and not foreign, f"{wheel.name} installs {foreign}"


def test_the_check_sees_a_foreign_name(tmp_path):
    """The check above can fail: a wheel with a top-level `kernels` is reported."""
    wheel = tmp_path / "x-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("kernels/__init__.py", "")
        z.writestr("x-0.dist-info/METADATA", "")
    with pytest.raises(AssertionError, match="installs \\['kernels'\\]"):
        test_every_top_level_name_the_wheels_install_is_loramux(({"x": wheel}, ""))


def test_the_server_wheel_carries_every_module_under_its_import_name(built):
    """pyproject lists each package (a mapped folder is not searched): none is missed."""
    wheels, _ = built
    expected = {f"{name}/{p.relative_to(REPO / folder).as_posix()}"
                for folder, name in FOLDERS.items() for p in (REPO / folder).rglob("*.py")
                if "__pycache__" not in p.parts}
    assert expected - set(_names(wheels["loramux"])) == set()


def test_the_build_prints_no_deprecation_warning(built):
    _, said = built
    assert "deprecat" not in said.lower(), said[-3000:]


def _import_from_the_checkout(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize("folder", ["engine", "services"])
def test_a_folder_is_not_importable_by_its_own_name(folder):
    """With the checkout on sys.path, `import engine` is refused, so no module has two names."""
    proc = _import_from_the_checkout(f"import {folder}")
    assert proc.returncode != 0
    assert f"{folder}/ installs as {FOLDERS[folder]}" in proc.stderr


def test_kernels_by_its_own_name_is_an_empty_stand_in():
    """`kernels` is Hugging Face's name, which transformers imports to probe: from the
    checkout it is an empty package (no file: "not installed" to such a probe) whose
    modules cannot be imported under that name."""
    proc = _import_from_the_checkout(
        "import kernels; assert kernels.__file__ is None and kernels.__path__ == []\n"
        "import kernels.lora")
    assert proc.returncode != 0 and "No module named 'kernels.lora'" in proc.stderr


def test_the_suite_imports_hugging_faces_kernels():
    """The suite's own process finds the installed `kernels`, not the checkout's folder."""
    spec = util.find_spec("kernels")
    assert spec is not None and Path(spec.origin).parent != REPO / "kernels", spec.origin


@pytest.mark.timeout(1200)
def test_installed_beside_transformers_peft_and_kernels(built, tmp_path):
    wheels, _ = built
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")

    def pip(*args):
        proc = subprocess.run([py, "-m", "pip", "install", "-q", *args], capture_output=True,
                              text=True, timeout=900, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    pip(f"torch=={metadata.version('torch').split('+')[0]}")   # the suite's own
    pip("-c", str(REPO / "constraints.txt"), "transformers", "peft", "kernels",
        *map(str, wheels.values()))
    model = make_model(tmp_path / "model")
    prompt = [1, 17, 93, 5, 250, 41]
    proc = subprocess.run([py, str(REPO / "tests/support/installed_check.py"), str(model),
                           str(tmp_path / "work"), json.dumps(prompt), "8"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["shared"] == {}, f"files owned by two distributions: {got['shared']}"
    assert Path(got["kernels"]).is_relative_to(venv), got["kernels"]
    assert got["hf"] and got["served"] == got["hf"]
