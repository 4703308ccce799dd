"""``bench/gpu_check.sh``, the one script a lent GPU runs in its few minutes: it parses as
bash, its default stages exist, and every bench command in it is one the bench accepts
(flags, models, systems, variants' options), checked here without a GPU so that no device
time is lost to a typo."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.step import parse_args

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh"


def _dry_print(**settings: str) -> str:
    """What the script's dry run prints (a line per command) with these environment settings."""
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "OUT": "out", **settings}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env,
                          check=True).stdout


def _dry_run() -> list[tuple[str, str, list[str]]]:
    """(``stage`` or ``warm``, name, the arguments its ``python -m bench.step`` gets) of every
    bench command, every stage and warm-up named, as the script's dry run prints them."""
    printed = _dry_print(STAGES="tier bench1 offload offload8 bench8 eager8 medium",
                         WARM="bench1 offload offload8 bench8 eager8 medium")
    commands = []
    for line in printed.splitlines():
        kind, name, *words = shlex.split(line)
        if words[:3] == ["python", "-m", "bench.step"]:
            commands.append((kind, name, words[3:]))
    return commands


def _bench_stages() -> dict[str, list[str]]:
    """Stage name -> the arguments its ``python -m bench.step`` gets."""
    return {name: argv for kind, name, argv in _dry_run() if kind == "stage"}


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
    assert set(stages) == {"bench1", "medium", "offload", "offload8", "bench8", "eager8"}
    for name, argv in stages.items():
        args = parse_args(argv)
        assert args.device == "cuda", name
        assert args.json.endswith(f"{name}.json"), name
    offload, offload8 = parse_args(stages["offload"]), parse_args(stages["offload8"])
    assert (offload.batch_size, offload8.batch_size) == (2, 8)
    assert (offload8.model, offload8.mixed_precision, offload8.seq_len) == (
        offload.model, offload.mixed_precision, offload.seq_len)
    warm = [(name, argv) for kind, name, argv in _dry_run() if kind == "warm"]
    for name, argv in warm:  # one compiled system each, the stage's model and precision
        args = parse_args(argv)
        stage = stages[name.rsplit("-", 1)[0]]
        assert len(args.systems) == 1 and args.systems[0] in parse_args(stage).systems, name
        assert not args.systems[0].startswith(("graphshard-eager", "fsdp2-eager")), name
        assert (args.model, args.mixed_precision) == (
            parse_args(stage).model, parse_args(stage).mixed_precision), name
    assert {name.rsplit("-", 1)[0] for name, _ in warm} == {
        "bench1", "offload", "offload8", "bench8", "medium"}  # eager8 compiles nothing
    with pytest.raises(SystemExit):  # the check bites: a misspelt variant option
        parse_args([*stages["bench1"], "--systems", "graphshard-compiled[reshard=auto]"])


def test_tier_k_selects_the_tier_cases_a_rerun_names():
    """``TIER_K`` reaches the tier's pytest as one ``-k`` expression, and the expression
    gpu_check.sh's header suggests selects cases that exist (collected here, skipped without
    a GPU): a rerun of the cases a fix touched spends no device time on the others."""
    expression = re.search(r'TIER_K="([^"]+)"', SCRIPT.read_text()).group(1)

    def tier_words(tier_k: str) -> list[str]:
        printed = _dry_print(STAGES="tier", TIER_K=tier_k)
        (line,) = [line for line in printed.splitlines() if line.startswith("stage tier ")]
        return shlex.split(line)

    words = tier_words(expression)
    assert words[words.index("-k") + 1] == expression
    assert "-k" not in tier_words("")
    tests = SCRIPT.parents[1] / "tests" / "gpu"
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
         str(tests), "-k", expression], capture_output=True, text=True, cwd=SCRIPT.parents[1])
    names = [n for n in collected.stdout.splitlines() if "::" in n]
    assert names and all(any(word in n for word in expression.split(" or ")) for n in names), \
        collected.stdout[-2000:]
    assert any("cpp_wrapper" in n for n in names), collected.stdout[-2000:]
