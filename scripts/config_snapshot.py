"""Snapshot every composed config under configs/, and compare two snapshots.

A refactor of the YAML tree (moving values into shared group files, interpolating them,
inheriting one experiment from another) should leave what every run sees unchanged. This
script writes, for each experiment (composed by the recipe it runs) and for each option of
each config group (composed into that group's primary config), the composed config twice:
unresolved, and resolved with the path variables set to fixed markers.

Usage::

    python scripts/config_snapshot.py dump before.json        # on the old tree
    python scripts/config_snapshot.py dump after.json         # on the new tree
    python scripts/config_snapshot.py diff before.json after.json [--ignore recipe --ignore launcher]

``diff`` prints every key whose resolved value changed, was added or removed (keys named
with ``--ignore`` are left out, at any depth), and exits 1 when any did.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

#: the path variables experiments interpolate, set to markers so a resolved config shows
#: which root each path hangs from
ENV = {"MMTUNE_OUTPUT_ROOT": "/OUTPUT_ROOT", "MMTUNE_DATA_ROOT": "/DATA_ROOT", "MMTUNE_CKPT_ROOT": "/CKPT_ROOT"}


def _recipe_of(name: str) -> str:
    """The recipe an experiment runs, by whatever means this tree's mmtune offers."""
    from mmtune.compose import experiment_recipe

    return experiment_recipe([f"experiment={name}"])


def _compose(overrides: list[str], config_name: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from mmtune.compose import compose_config

    cfg = compose_config(overrides, config_name)
    return {"unresolved": OmegaConf.to_container(cfg, resolve=False),
            "resolved": OmegaConf.to_container(cfg, resolve=True)}


def dump(out: Path) -> int:
    from mmtune.data.config import configs_dir

    os.environ.update(ENV)
    root = Path(configs_dir())
    snapshot: dict[str, Any] = {}
    for path in sorted((root / "experiment").glob("*.yaml")):
        recipe = _recipe_of(path.stem)
        snapshot[f"experiment={path.stem}"] = {"recipe": recipe, **_compose([f"experiment={path.stem}"], recipe)}
    for group in ("model", "data", "collator", "training", "peft", "context", "logging", "eval"):
        for path in sorted((root / group).glob("*.yaml")):
            override = f"{group}={path.stem}"
            extra = ["model=llava_1_5_7b"] if override == "peft=qlora" else []
            snapshot[override] = {"recipe": "sft", **_compose([override, *extra], "sft")}
            if group == "eval":
                snapshot[f"evaluate:{override}"] = {"recipe": "evaluate", **_compose([override], "evaluate")}
    out.write_text(json.dumps(snapshot, indent=1, sort_keys=True, default=str))
    print(f"{len(snapshot)} compositions written to {out}")
    return 0


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return flat or {prefix: {}}
    if isinstance(value, list):
        flat = {}
        for i, item in enumerate(value):
            flat.update(_flatten(item, f"{prefix}[{i}]"))
        return flat or {prefix: []}
    return {prefix: value}


def diff(before_path: Path, after_path: Path, ignore: list[str]) -> int:
    before, after = json.loads(before_path.read_text()), json.loads(after_path.read_text())
    changed = 0
    for name in sorted(set(before) | set(after)):
        if name not in after or name not in before:
            print(f"{name}: only in {'before' if name in before else 'after'}")
            changed += name in before  # a new composition (a new file) is no change to an old one
            continue
        old, new = _flatten(before[name]["resolved"]), _flatten(after[name]["resolved"])
        lines = []
        for key in sorted(set(old) | set(new)):
            if any(part in ignore for part in key.replace("[", ".").split(".")):
                continue
            if old.get(key, "<absent>") != new.get(key, "<absent>") or (key in old) != (key in new):
                lines.append(f"  {key}: {old.get(key, '<absent>')!r} -> {new.get(key, '<absent>')!r}")
        if before[name].get("recipe") != after[name].get("recipe"):
            lines.append(f"  (recipe) {before[name].get('recipe')} -> {after[name].get('recipe')}")
        if lines:
            changed += 1
            print(f"{name}:\n" + "\n".join(lines))
    same = len(set(before) & set(after)) - changed
    print(f"{same} composition(s) unchanged, {changed} changed (resolved values; ignored keys: {ignore or 'none'})")
    return 1 if changed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out", type=Path)
    c = sub.add_parser("diff")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--ignore", action="append", default=[], help="a key name to leave out, at any depth")
    args = parser.parse_args(argv)
    if args.command == "dump":
        return dump(args.out)
    return diff(args.before, args.after, args.ignore)


if __name__ == "__main__":
    sys.exit(main())
