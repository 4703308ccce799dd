"""Docs that cannot drift: README's size and set-up commands, every Python example compiles,
the runnable ones run on 2 gloo ranks, and every relative link (and anchor) resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from docs_jobs import ROOT, TAGS, doc_files, python_blocks, run_blocks

README = ROOT / "README.md"


def test_readme_is_a_front_page():
    assert README.stat().st_size < 12 * 1024, "README.md must stay under 12 KB: move text to docs/"
    text = README.read_text()
    # .ci/run runs README's test command: the same install and the same pytest options
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -q torch==2.13.0 -e ".[test]"' in ci
    (pytest_line,) = [line for line in ci.splitlines() if line.startswith("python3 -m pytest")]
    options = pytest_line.removeprefix("python3 -m pytest")
    assert f'pip install torch==2.13.0 -e ".[test]" && pytest{options}\n' in text
    assert ("pip install torch==2.13.0 -e . && torchrun --nproc-per-node 2 "
            "examples/train_llama.py") in text
    assert "pip install --no-deps -e ." in text and "python -m pytest -q tests/gpu" in text
    png = ROOT / "docs" / "schedule.png"
    assert png.is_file() and png.stat().st_size < 150 * 1024


def test_every_python_example_compiles_and_is_tagged():
    blocks = python_blocks()
    assert any("runnable" in b.tags for b in blocks)
    for block in blocks:
        assert set(block.tags) <= TAGS, f"{block.name}: unknown tags {block.tags}"
        assert not ("runnable" in block.tags and {"gpu", "download"} & set(block.tags)), block.name
        compile(block.source, block.name, "exec")


def test_runnable_examples_run_on_two_ranks():
    blocks = [b for b in python_blocks() if "runnable" in b.tags]
    times = run_blocks(blocks)
    assert [name for name, _ in times[0]] == [b.name for b in blocks]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    fence = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):  # a list item indents its fences
            fence = not fence
        match = None if fence else re.match(r"#{1,6} (.*)", line)
        if match:
            slug = _slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(path: Path) -> list[str]:
    text = re.sub(r"^[ \t]*(`{3,}).*?^[ \t]*\1", "", path.read_text(),
                  flags=re.S | re.M)  # code blocks, a list item's indented too
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    for link in _links(path):
        if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        assert file.exists(), f"{path.name}: broken link {link}"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file), f"{path.name}: no heading for #{anchor} in {link}"
