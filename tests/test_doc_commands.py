"""The commands the docs give (``graphshard plan ...``, ``python -m bench.step ...``) parse
with the tools' own argument parsers: a renamed or removed flag, a model preset or bench
system that no longer exists, fails here instead of in a reader's shell.

A command shown whole is parsed as it is; ``bench.step``'s go through its own checks too
(systems and their options, warm-up against steps). A command shown in part (``...``,
``[optional]`` pieces, a flag named in prose without its value) has each of its flags looked
up."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex

import pytest
from docs_jobs import doc_files

from graphshard.tools import cli

TOOL = re.compile(r"(graphshard (?:dump|plan|calibrate)|python -m bench\.[a-z_]+)(?![\w.])")
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")


def documented_commands() -> list[tuple[str, str]]:
    """(file name, command) for every command of a tool in a code block line or an inline
    code span (which may wrap across lines); shell continuations joined, comments cut."""
    found = []
    for path in doc_files():
        text = path.read_text().replace("\\\n", " ")
        parts = re.split(r"^[ \t]*```.*$", text, flags=re.M)  # list items indent theirs
        for index, part in enumerate(parts):
            if index % 2:  # inside a fence
                pieces = [line.split(" #")[0] for line in part.splitlines()]
            else:
                pieces = [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", part)]
            for piece in pieces:
                match = TOOL.search(piece)
                if match:
                    found.append((path.name, piece[match.start():].strip()))
    return found


class _Parser(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def tool_parser(tool: str) -> argparse.ArgumentParser:
    """The parser a tool builds: the ``graphshard`` subcommand's, or the one a bench module's
    ``main`` builds (caught as it parses, before anything runs)."""
    if tool.startswith("graphshard "):
        sub = next(a for a in cli.build_parser()._actions
                   if isinstance(a, argparse._SubParsersAction))
        return sub.choices[tool.split()[1]]
    module = importlib.import_module(tool.removeprefix("python -m "))

    def caught(self, args=None, namespace=None):
        raise _Parser(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", caught)
        patch.setattr(argparse.ArgumentParser, "parse_known_args", caught)
        try:
            module.main(["--help"])
        except _Parser as found:
            return found.parser
    raise AssertionError(f"{tool}: main() built no argument parser")


COMMANDS = documented_commands()


def test_the_docs_give_commands_of_every_tool():
    tools = {TOOL.match(command).group(1) for _, command in COMMANDS}
    assert {"graphshard plan", "graphshard dump", "python -m bench.step"} <= tools
    assert len(COMMANDS) > 30


@pytest.mark.parametrize("where, command", COMMANDS,
                         ids=[f"{w}:{c[:60]}" for w, c in COMMANDS])
def test_a_documented_command_parses(where, command):
    tool = TOOL.match(command).group(1)
    parser = tool_parser(tool)
    known = set(parser._option_string_actions)
    unknown = [flag for flag in FLAG.findall(command) if flag not in known]
    assert not unknown, f"{where}: `{command}` uses {unknown}, which {tool} does not take"
    unquoted = re.sub(r"'[^']*'", "", command)  # a bench variant's brackets are quoted
    whole = not re.search(r"\.\.\.|[\[\]()<>]", unquoted) and "--device cuda" not in command
    last = command.split()[-1]
    if last in known and parser._option_string_actions[last].nargs != 0:
        whole = False  # a flag named in prose, without its value
    if not whole or not FLAG.search(command):
        return
    argv = shlex.split(command)[len(tool.split()):]
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        try:
            if tool == "python -m bench.step":
                from bench.step import parse_args

                parse_args(argv)  # its own checks: systems, variants' options, steps
            else:
                parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: `{command}` does not parse: {errors.getvalue().strip()}")
