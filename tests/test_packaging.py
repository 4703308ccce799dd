"""How graphshard installs: the root folder ``passes/`` becomes ``graphshard.passes``, so a
user's own ``passes.py`` or ``passes/`` in the working directory cannot shadow it, installed
or run from a source checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]

# Imports graphshard's whole public surface and a pass, then says where the passes came from.
_PROBE = (
    "import sys, graphshard, graphshard.passes.runner\n"
    "from graphshard import shard, backend\n"
    "assert 'passes' not in sys.modules, 'a top-level passes was imported'\n"
    "print(graphshard.passes.__file__)\n"
)
# The same with the editable install's finder removed: a checkout on PYTHONPATH only.
_UNINSTALLED = (
    "import sys\n"
    "sys.meta_path[:] = [f for f in sys.meta_path\n"
    "                    if 'editable' not in getattr(f, '__name__', type(f).__name__).lower()]\n"
    + _PROBE
)


def _decoys(folder: Path) -> None:
    (folder / "passes.py").write_text("raise ImportError('the decoy passes.py was imported')\n")


def _run(code: str, cwd: Path, pythonpath: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_import_works_beside_a_decoy_passes_module(tmp_path):
    _decoys(tmp_path)
    where = _run(_PROBE, tmp_path)
    assert Path(where).resolve() == ROOT / "passes" / "__init__.py"


def test_import_works_beside_a_decoy_passes_package(tmp_path):
    (tmp_path / "passes").mkdir()
    (tmp_path / "passes" / "__init__.py").write_text("raise ImportError('decoy package')\n")
    _run(_PROBE, tmp_path)


def test_a_checkout_on_pythonpath_mounts_the_passes_beside_a_decoy(tmp_path):
    _decoys(tmp_path)
    where = _run(_UNINSTALLED, tmp_path, pythonpath=str(ROOT))
    assert Path(where).resolve() == ROOT / "passes" / "__init__.py"


def _package_folders() -> dict[str, Path]:
    found = {}
    for init in (ROOT / "graphshard").rglob("__init__.py"):
        found[".".join(init.parent.relative_to(ROOT).parts)] = init.parent
    found["graphshard.passes"] = ROOT / "passes"
    return found


def test_pyproject_lists_every_package_folder():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert sorted(setup["packages"]) == sorted(_package_folders())
    assert setup["package-dir"] == {"graphshard.passes": "passes"}


def test_the_wheel_holds_the_passes_under_graphshard(tmp_path):
    source = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "build", "*.egg-info", "__pycache__", "tests", "bench", "examples", "dumps"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(source)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = tmp_path.glob("graphshard-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"graphshard/passes/{p.name}" for p in (ROOT / "passes").glob("*.py")}
    assert expected <= names
    assert not any(n.startswith("passes/") for n in names)
    for package, folder in _package_folders().items():
        prefix = package.replace(".", "/")
        assert {f"{prefix}/{p.name}" for p in folder.glob("*.py")} <= names, package
