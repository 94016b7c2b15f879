"""The `specstream` parser against tests/data/cli_flags.json, a snapshot of every subcommand's
arguments taken before the CLI was split into one module per group of subcommands: the split
changed no flag (name, destination, default, choices, nargs, action, type, help, metavar, order).
The additions since: `--quiet` on the long-running commands, and `bench step` (the snapshot
records the bench kinds with it); `--draft-timeout` 10 -> 2.5 s (below the gateway's hang floor). `bench --compiled`; `train-draft --kind`
(token or feature), `--epochs`, `--extra-layers`, `--aligned`, `--train-fraction`, `--head-vocab` and the feature draft's stages (`offline` among them) (then `token` and `--out` for it too); `bench --compare-draft` and `--prompt-set`; the `smollm2` pair's description (its feature draft); `fuzz --draft-side` and `--corrupt`; `bench overlap`; `--tree-branches` (target, serve; its help since sampled rows branch too); `bench --no-trees` (and its help since it covers `bench sampling`); `--draft-early` (target, serve), `--work-ahead` (draft, serve), `--compute-thread` (draft) and `bench overlap`'s help (its served part); `--prompt-set nonsense` and `--repeats` for `bench sampling`; `--work-ahead-outcomes` (draft, serve, target) and `--work-ahead` (target: its in-process draft; serve's help since it covers a colocated draft); `bench --auto-stack`; the `--work-ahead` help on draft, serve and target since sampling rows work ahead too; `bench --temperatures`'s help (overlap's served part); `--fixed-threads` (target, serve); `train-draft --structured`, `--per-subject`, `--init-from`, `--lr`
and `--vocab-out` (a further training on structured-output tasks); `train-draft --stage structured`; `--weights int4-a16` (and auto's help). And each
subcommand still runs its own cmd_* function.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
from pathlib import Path

import pytest

import tools.cli as cli
from tools.cli import build_parser

SNAPSHOT = Path(__file__).parent / "data" / "cli_flags.json"

# The commands that show a progress bar, and so take --quiet (added after the snapshot).
QUIET_COMMANDS = {"bench", "train-draft", "fuzz", "soak", "faults", "experiment"}
QUIET = {"flags": ["--quiet"], "dest": "quiet", "default": "False", "choices": None, "nargs": 0, "required": False,
         "action": "_StoreTrueAction", "help": "no progress bar: plain progress lines only", "metavar": None,
         "type": None}

# The least each subcommand parses with (its required arguments).
MINIMAL_ARGS = {"target": ["--model", "m"], "gateway": ["--target-url", "t:1", "--tokenizer", "m"],
                "generate": ["hello"], "chat": ["hello"], "bench": ["latency"]}


def describe(parser: argparse.ArgumentParser) -> list[dict]:
    """A parser's arguments as the snapshot records them (the script that took it, verbatim)."""
    out = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            continue
        out.append({"flags": list(a.option_strings) or [a.dest], "dest": a.dest, "default": repr(a.default),
                    "choices": list(a.choices) if a.choices else None, "nargs": a.nargs, "required": a.required,
                    "action": type(a).__name__, "help": a.help, "metavar": a.metavar,
                    "type": getattr(a.type, "__name__", repr(a.type)) if a.type else None})
    return out


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


@pytest.fixture
def parser(monkeypatch) -> argparse.ArgumentParser:
    """The parser as the snapshot was taken: no SPECSTREAM_* variable set (they become defaults)."""
    for name in list(os.environ):
        if name.startswith("SPECSTREAM_"):
            monkeypatch.delenv(name)
    return build_parser()


def test_every_subcommands_arguments_match_the_snapshot_in_order(parser) -> None:
    snapshot = json.loads(SNAPSHOT.read_text())
    now = {name: describe(sub) for name, sub in subparsers(parser).items()}
    assert list(now) == ["serve", "target", "draft", "gateway", "generate", "chat", "health", "train-demo",
                         "train-draft", "bench", "experiment", "fuzz", "soak", "faults", "demo"]  # --help's order
    assert set(now) == set(snapshot)
    for name, arguments in now.items():
        without_quiet = [a for a in arguments if a["dest"] != "quiet"]
        assert without_quiet == snapshot[name], name


def test_the_long_running_commands_and_only_they_gained_quiet(parser) -> None:
    snapshot = json.loads(SNAPSHOT.read_text())
    for name, sub in subparsers(parser).items():
        quiet = [a for a in describe(sub) if a["dest"] == "quiet"]
        assert quiet == ([QUIET] if name in QUIET_COMMANDS else []), name
        assert not any(a["dest"] == "quiet" for a in snapshot[name])  # an addition, not a flag renamed
    assert parser.parse_args(["bench", "gamma", "--quiet"]).quiet is True
    assert parser.parse_args(["soak"]).quiet is False


def test_each_subcommand_runs_its_own_function(parser) -> None:
    funcs = {name: sub.get_default("func") for name, sub in subparsers(parser).items()}
    for name, func in funcs.items():
        assert func.__name__ == "cmd_" + name.replace("-", "_"), name
        assert func.__module__.startswith("tools.cli."), (name, func.__module__)
    assert len(set(funcs.values())) == len(funcs)  # no two subcommands share one


@pytest.mark.parametrize("command", ["serve", "target", "draft", "gateway", "generate", "chat", "health",
                                     "train-demo", "train-draft", "bench", "experiment", "fuzz", "soak", "faults",
                                     "demo"])
def test_main_dispatches_to_the_subcommands_function(command: str, parser, monkeypatch) -> None:
    func = subparsers(parser)[command].get_default("func")
    module = importlib.import_module(func.__module__)
    seen = []
    monkeypatch.setattr(module, func.__name__, lambda args: seen.append(args) or 7)
    assert cli.main([command, *MINIMAL_ARGS.get(command, [])]) == 7  # main returns the function's code
    assert len(seen) == 1 and seen[0].command == command
