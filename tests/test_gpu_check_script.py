"""``bench/gpu_check.sh``, the one script a lent GPU runs in its few minutes: it parses as
bash, its default stages exist, and every bench command in it is one the bench accepts
(flags, models, systems, variants' options), checked here without a GPU so that no device
time is lost to a typo."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from bench.step import parse_args

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh"


def _bench_stages() -> dict[str, list[str]]:
    """Stage name -> the arguments its ``python -m bench.step`` gets (shell words, with
    ``$OUT`` left as text)."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    stages = {}
    for line in text.splitlines():
        found = re.match(r'\s*stage (\w+) "\$\{\w+:-\d+\}" python -m bench\.step (.*)$', line)
        if found:
            stages[found.group(1)] = shlex.split(found.group(2))
    return stages


def test_the_script_parses_as_bash():
    checked = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def test_every_default_and_named_stage_is_defined():
    text = SCRIPT.read_text()
    (defaults,) = re.findall(r'STAGES=\$\{STAGES:-"([^"]*)"\}', text)
    defined = set(re.findall(r"^stage (\w+) ", text.replace("\\\n", " "), flags=re.M))
    assert set(defaults.split()) <= defined
    assert {"tier", "bench1", "medium", "offload", "bench8"} <= defined


def test_every_bench_command_is_one_the_bench_accepts(monkeypatch):
    """The bench's own argument checks, as on an 8-GPU machine: an unknown flag, model,
    system or variant option stops here, not on the GPU."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    stages = _bench_stages()
    assert set(stages) == {"bench1", "medium", "offload", "bench8"}
    for name, argv in stages.items():
        args = parse_args(argv)
        assert args.device == "cuda", name
        assert args.json.endswith(f"{name}.json"), name
    with pytest.raises(SystemExit):  # the check bites: a misspelt variant option
        parse_args([*stages["bench1"], "--systems", "graphshard-compiled[reshard=auto]"])
