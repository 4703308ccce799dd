"""docs/api.md against the code: every signature in a heading is the function's own (names,
order, defaults), and the backend's options table lists exactly the options
``graphshard.backend`` takes, each with its real default. Every public name has a docstring
and type hints."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
from docs_jobs import ROOT

import graphshard
from graphshard.compiler.backend import GraphshardBackend
from graphshard.passes import Plan
from graphshard.passes.plan import parse_bytes

API = (ROOT / "docs" / "api.md").read_text()
# Defaults the table states as what they mean rather than as the value.
STATED_AS = {"dump_dir": "$GRAPHSHARD_DUMP_DIR"}  # None: read from the environment


def _rendered(signature: inspect.Signature) -> list[str]:
    """The parameters as a heading writes them: ``name``, ``name=default``, ``*``,
    ``**name`` (no annotations)."""
    out, star = [], False
    for p in signature.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        if p.kind is p.VAR_KEYWORD:
            out.append(f"**{p.name}")
        elif p.default is p.empty:
            out.append(p.name)
        else:
            out.append(f"{p.name}={p.default!r}")
    return out


HEADINGS = re.findall(r"^## `graphshard\.(\w+)\((.*?)\)`", API, flags=re.M)


def test_the_page_has_signature_headings():
    assert {"shard", "backend", "clip_grad_norm_", "CPUOffload"} <= {n for n, _ in HEADINGS}


@pytest.mark.parametrize("name, params", HEADINGS, ids=[n for n, _ in HEADINGS])
def test_a_headings_signature_is_the_functions(name, params):
    documented = [p.strip() for p in params.split(",")] if params else []
    assert documented == _rendered(inspect.signature(getattr(graphshard, name))), (
        f"docs/api.md's heading for graphshard.{name} is out of date")


def _options_table() -> dict[str, str]:
    section = API.split("## `graphshard.backend(**options)`", 1)[1].split("\nOptions:\n", 1)[1]
    rows = {}
    for line in section.strip().splitlines():
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        match = re.fullmatch(r"`(\w+)`", cells[0])
        if match:
            rows[match.group(1)] = cells[1].strip("`")
    return rows


def _backend_defaults() -> dict[str, object]:
    own = {name: p.default for name, p in inspect.signature(GraphshardBackend).parameters.items()
           if p.kind is p.KEYWORD_ONLY}
    return own | {f.name: f.default for f in dataclasses.fields(Plan) if f.init}


def _matches(stated: str, default: object) -> bool:
    if isinstance(default, bool) or default is None:
        return stated == str(default)
    if isinstance(default, str):
        return stated == f'"{default}"'
    if isinstance(default, float):
        return float(stated) == default
    if isinstance(default, int):  # a count, or a byte size such as 25 MiB
        return stated == str(default) or (" " in stated and parse_bytes(stated) == default)
    return False


def test_the_backend_options_table_is_the_backends():
    table, defaults = _options_table(), _backend_defaults()
    assert set(table) == set(defaults), (
        f"docs/api.md's options table: missing {sorted(set(defaults) - set(table))}, "
        f"not options {sorted(set(table) - set(defaults))}")
    for name, default in defaults.items():
        stated = table[name]
        if name in STATED_AS:
            assert stated == STATED_AS[name], name
        else:
            assert _matches(stated, default), f"{name}: the table says {stated}, code {default!r}"


def test_the_backends_docstring_names_every_plan_option():
    doc = inspect.getdoc(GraphshardBackend)
    missing = [f.name for f in dataclasses.fields(Plan) if f.init and f"``{f.name}``" not in doc]
    assert not missing, f"GraphshardBackend's docstring does not name {missing}"


def _unannotated(fn) -> list[str]:
    signature = inspect.signature(fn)
    missing = [p.name for p in signature.parameters.values()
               if p.annotation is p.empty and p.name not in ("self", "cls")]
    if signature.return_annotation is signature.empty:
        missing.append("return")
    return missing


def _public_functions(obj) -> list:
    """``obj`` itself where it is a function; a class's ``__init__`` and public methods."""
    if inspect.isfunction(obj):
        return [obj]
    if inspect.isclass(obj):
        return [member for attr, member in vars(obj).items() if inspect.isfunction(member)
                and (not attr.startswith("_") or attr == "__init__")]
    return []


@pytest.mark.parametrize("name", graphshard.__all__)
def test_public_names_have_docstrings_and_type_hints(name):
    obj = getattr(graphshard, name)
    assert inspect.getdoc(obj), f"graphshard.{name} has no docstring"
    for fn in _public_functions(obj):
        assert not _unannotated(fn), f"{fn.__qualname__}: no type hint for {_unannotated(fn)}"
