"""The package installs three ways (wheel, `pip install .`, `pip install -e .`) and each one imports the
subpackages under their dtprof.* names, with nothing generic (collectors/, analyzers/, reports/) at top level."""
from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("dtprof.collectors", "dtprof.analyzers", "dtprof.reports", "dtprof._inject")


def _pip(py: Path, *args: str) -> None:
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", *args], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _fresh_venv(path: Path) -> Path:
    venv.EnvBuilder(with_pip=True).create(path)
    return path / "bin" / "python"


def _imports(py: Path) -> list[str]:
    code = ("import importlib, json; mods = %r; "
            "print(json.dumps([importlib.import_module(m).__name__ for m in mods]))" % (SUBPACKAGES,))
    out = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True, cwd="/")
    return eval(out.stdout)  # a list of module names, printed by us


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    (whl,) = out.glob("dtprof-*.whl")
    return whl


def test_wheel_maps_subpackages_under_dtprof(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for sub in ("collectors", "analyzers", "reports"):
        assert f"dtprof/{sub}/__init__.py" in names
        assert not any(n.startswith(f"{sub}/") for n in names), f"generic top-level {sub}/ in the wheel"
    assert "dtprof/_inject/sitecustomize.py" in names
    assert not any(n.startswith("tests/") for n in names)


@pytest.mark.parametrize("how", ["wheel", "pip install .", "pip install -e ."])
def test_installed_package_imports_subpackages(how, wheel, tmp_path):
    py = _fresh_venv(tmp_path / "venv")
    target = {"wheel": [str(wheel)], "pip install .": [str(REPO)], "pip install -e .": ["-e", str(REPO)]}[how]
    _pip(py, *target)
    assert _imports(py) == list(SUBPACKAGES)
