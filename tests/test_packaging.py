"""How graphshard installs: the root folder ``passes/`` becomes ``graphshard.passes``, so a
user's own ``passes.py`` or ``passes/`` in the working directory cannot shadow it, installed
or run from a source checkout."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

import graphshard
from graphshard import _torch_version

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
    """The installed graphshard's own passes (of this checkout where it is the one installed;
    a clone tested beside another checkout's editable install sees that one's)."""
    _decoys(tmp_path)
    passes, package = _run(_PROBE + "print(graphshard.__file__)\n", tmp_path).splitlines()
    package_dir = Path(package).resolve().parent
    assert Path(passes).resolve() in (package_dir / "passes" / "__init__.py",  # a wheel
                                      package_dir.parent / "passes" / "__init__.py")


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


# --------------------------------------------------------------------------- the torch floor


def test_the_torch_floor_in_pyproject_is_min_torch():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_dep,) = [d for d in deps if re.match(r"torch\b", d)]
    match = re.fullmatch(r"torch\s*>=\s*(\d+)\.(\d+)", torch_dep)
    assert match, f"expected 'torch>=X.Y' in pyproject.toml, found {torch_dep!r}"
    assert (int(match[1]), int(match[2])) == graphshard.MIN_TORCH == (2, 11)


@pytest.mark.parametrize("version, expected", [
    ("2.11.0", (2, 11)), ("2.11.0+cu130", (2, 11)), ("2.14.1", (2, 14)),
    ("2.12.0.dev20260101+cpu", (2, 12)), ("2.11.0a0+git1234567", (2, 11)), ("10.0", (10, 0)),
])
def test_torch_versions_read_as_major_minor(version, expected):
    assert _torch_version._major_minor(version) == expected


def test_an_older_torch_fails_the_check_naming_the_versions(monkeypatch):
    _torch_version.check_torch_version()  # the torch running these tests is supported
    for supported in [(2, 11), (2, 14), (3, 0)]:
        monkeypatch.setattr(_torch_version, "installed_torch_version", lambda v=supported: v)
        _torch_version.check_torch_version()
    monkeypatch.setattr(_torch_version, "installed_torch_version", lambda: (2, 10))
    with pytest.raises(ImportError, match=r"graphshard needs torch>=2\.11.*\(2\.10\)"):
        _torch_version.check_torch_version()


# Loads graphshard._torch_version alone, makes it see torch 2.10, then imports graphshard.
_OLD_TORCH = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('graphshard._torch_version', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = module\n"
    "spec.loader.exec_module(module)\n"
    "module.installed_torch_version = lambda: (2, 10)\n"
    "try:\n"
    "    import graphshard\n"
    "except ImportError as exc:\n"
    "    assert 'graphshard.api' not in sys.modules, 'the check ran after other imports'\n"
    "    print(exc)\n"
    "else:\n"
    "    raise SystemExit('graphshard imported on torch 2.10')\n"
)


def test_importing_graphshard_on_an_older_torch_raises_a_clear_import_error(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _OLD_TORCH, str(ROOT / "graphshard" / "_torch_version.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    message = done.stdout.strip()
    assert message.startswith("graphshard needs torch>=2.11, but torch "), message
    assert "(2.10) is installed" in message


def test_a_second_checkout_on_pythonpath_runs_its_own_passes(tmp_path):
    """A copy of the checkout on ``PYTHONPATH`` while the editable install points at this one
    (two clones, one installed): its ``graphshard`` and its ``graphshard.passes`` both come
    from the copy, never the package of one tree with the passes of the other."""
    copy = tmp_path / "clone"
    for name in ("graphshard", "passes"):
        shutil.copytree(ROOT / name, copy / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    where = _run(_PROBE + "print(graphshard.__file__)\n", tmp_path, pythonpath=str(copy))
    passes, package = where.splitlines()
    assert Path(package).resolve() == copy / "graphshard" / "__init__.py"
    assert Path(passes).resolve() == copy / "passes" / "__init__.py"
