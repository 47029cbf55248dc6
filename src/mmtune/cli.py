"""The ``mmtune`` command: a thin dispatcher to each subcommand's own ``main(argv)``.

Subcommands are imported only when called, so ``mmtune data check`` does not import
torch's training stack and ``mmtune --help`` is instant.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "data": ("mmtune.data.check", "validate data (`mmtune data check CONFIG`) or build it (`mmtune data build CONFIG`)"),
    "demo": ("mmtune.training.demo", "generate synthetic data, train the tiny LLaVA on CPU, evaluate it"),
    "train": ("mmtune.training.cli", "fine-tune on a config or your own data files (data.files=[...])"),
    "plan": ("mmtune.training.plan", "resolve a run or sweep without loading weights; print steps, tokens, cost"),
    "report": ("mmtune.evaluation.reporting.tables", "render the paper's tables with our numbers beside them"),
    "evaluate": ("mmtune.evaluation.cli", "score a predictions file or evaluate a checkpoint"),
}


def _usage() -> str:
    lines = ["usage: mmtune <command> [args...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name == "data" and rest[:1] == ["build"]:
        from mmtune.data.build.cli import main as build_main

        return int(build_main(rest[1:]) or 0)
    if name == "data":  # the check measures against a run's window with the model it names
        from mmtune.data.check import main as data_main
        from mmtune.training.data_window import training_window

        return int(data_main(rest, training_window=training_window) or 0)
    if name not in SUBCOMMANDS:
        print(f"mmtune: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
