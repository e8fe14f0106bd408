"""The project installs as one package, vmkv: paging/ and drivers/ are vmkv.paging and vmkv.drivers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib, sys
import vmkv.drivers, vmkv.paging
print("vmkv.drivers", vmkv.drivers.__file__)
for name in ("paging", "drivers"):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        print(name, "missing")
    else:
        print(name, "importable")
"""


def probe(cwd: Path, extra_path: Path | None = None) -> dict[str, str]:
    """Run PROBE in a fresh interpreter outside the repository; {module: result}."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return dict(line.split(" ", 1) for line in out.stdout.splitlines())


def test_installed_package_imports_only_under_vmkv(tmp_path):
    got = probe(tmp_path)
    assert got["paging"] == "missing" and got["drivers"] == "missing"
    assert Path(got["vmkv.drivers"]).name == "__init__.py"


def build_wheel(tmp_path: Path) -> Path:
    """Build from a copy of the sources, so the build leaves nothing in the repository."""
    src = tmp_path / "src"
    src.mkdir()
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name in {"pyproject.toml", "README.md", "LICENSE", *package_dirs.values()}:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif path.exists():
            shutil.copy(path, src / name)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    out = subprocess.run(
        [*pip_wheel, "-w", str(tmp_path), "."], cwd=src, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = tmp_path.glob("vmkv-*.whl")
    return wheel


def test_wheel_holds_only_the_vmkv_package(tmp_path):
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"vmkv"}
    assert {"vmkv/paging/__init__.py", "vmkv/drivers/__init__.py", "vmkv/drivers/host.py"} <= set(names)

    # A non-editable install of a pure wheel is its unpacked tree on the path.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    work = tmp_path / "elsewhere"
    work.mkdir()
    got = probe(work, extra_path=site)
    assert got["paging"] == "missing" and got["drivers"] == "missing"
    assert Path(got["vmkv.drivers"]).is_relative_to(site)
