"""Compose a recipe's Hydra config the way the recipe sees it, without running the recipe.

``mmtune plan``, ``mmtune demo``, ``mmtune train``, ``mmtune evaluate``, bench scripts and
tests all build configs here: ``configs/<recipe>.yaml`` with Hydra overrides, after
registering the typed schemas, with no change of working directory and no logging setup
(Hydra's compose API).

Every entry point treats ``experiment=<name>`` alike (:func:`normalize_overrides`: the
``sft`` config has an ``experiment`` default, ``evaluate`` has none, so either spelling,
with or without ``+``, is turned into the one that config needs), and answers a bad
override with one short message instead of Hydra's exception (:func:`compose_checked`):
the key, the closest known key, and where the known keys are; an experiment written for
the other recipe is told which command runs it.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["RECIPES", "COMMANDS", "OverrideError", "compose_config", "compose_checked", "normalize_overrides",
           "experiment_name", "experiment_recipe", "explain_compose_error", "check_recipe_overrides",
           "experiment_key", "register_resolvers"]

#: recipe name -> its script; the name is also the primary config under configs/
RECIPES = {"sft": "recipes/sft.py", "evaluate": "recipes/evaluate.py"}
#: recipe name -> the ``mmtune`` command that runs it
COMMANDS = {"sft": "mmtune train", "evaluate": "mmtune evaluate"}


class OverrideError(ValueError):
    """A command line's overrides do not compose; the message says what, where and how to fix it."""


def normalize_overrides(overrides: Sequence[str], config_name: str = "sft") -> list[str]:
    """``experiment=x`` / ``+experiment=x`` in the spelling ``configs/<config_name>.yaml`` needs:
    ``sft`` lists ``experiment`` in its defaults (``experiment=x``), ``evaluate`` does not
    (``+experiment=x``)."""
    if config_name == "evaluate":
        return [f"+{o}" if o.startswith("experiment=") else o for o in overrides]
    return [o[1:] if o.startswith("+experiment=") else o for o in overrides]


def compose_config(overrides: Sequence[str], config_name: str = "sft") -> Any:
    """Compose ``configs/<config_name>.yaml`` with Hydra ``overrides``.

    ``config_name`` is ``sft`` (recipes/sft.py) or ``evaluate`` (recipes/evaluate.py);
    ``experiment=x`` and ``+experiment=x`` both work for either (:func:`normalize_overrides`).

    Returns:
        The composed ``DictConfig``, interpolations unresolved.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from mmtune.data.config import configs_dir
    from mmtune.evaluation.config import register_configs as register_eval
    from mmtune.training.config import register_configs

    register_configs()
    register_eval()
    overrides = normalize_overrides(overrides, config_name)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(Path(configs_dir()).resolve()), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


def experiment_name(overrides: Sequence[str]) -> Optional[str]:
    """The name an ``experiment=`` (or ``+experiment=``) override picks, if any."""
    for o in overrides:
        key, _, name = o.partition("=")
        if key.lstrip("+") == "experiment" and name:
            return name
    return None


def experiment_recipe(overrides: Sequence[str]) -> str:
    """The recipe (``sft`` or ``evaluate``) an ``experiment=`` override's experiment states in
    its typed ``recipe`` key (:class:`mmtune.experiment.Recipe`); ``sft`` without an
    experiment, or when it does not compose (composing it for its recipe then says why).

    Every experiment composes into ``configs/sft.yaml`` (its schema holds every section an
    evaluation experiment sets), so that is where the key is read, parents included.
    """
    name = experiment_name(overrides)
    if not name:
        return "sft"
    try:
        cfg = compose_config([f"experiment={name}"], "sft")
    except Exception:  # an unknown name or a broken file: the recipe's own compose reports it
        return "sft"
    return _recipe_value(cfg)


def _recipe_value(cfg: Any) -> str:
    from omegaconf import OmegaConf

    recipe = OmegaConf.select(cfg, "recipe", default="sft")
    return str(getattr(recipe, "value", recipe))


def _schema(config_name: str) -> type:
    if config_name == "evaluate":
        from mmtune.evaluation.config import EvaluateConfig

        return EvaluateConfig
    from mmtune.training.config import SFTConfig

    return SFTConfig


def explain_compose_error(err: BaseException, config_name: str = "sft") -> str:
    """Hydra's or OmegaConf's exception for a bad override as one short message.

    Unknown keys get the closest known key (difflib) and the schema class that lists the
    known ones; unknown group options (``model=llava_tin``) the closest option and the
    folder of choices; a value of the wrong type its key. Anything else: the first line.
    """
    from hydra.errors import MissingConfigException, OverrideParseException

    from mmtune.schema_keys import describe_unknown_key

    text = str(err)
    if isinstance(err, MissingConfigException):
        found = re.search(r"Could not find '([^']+)'", text)
        if found and "/" in found.group(1):
            group, name = found.group(1).rsplit("/", 1)
            options = list(getattr(err, "options", None) or [])
            close = difflib.get_close_matches(name, options, n=1)
            hint = f" (closest: {close[0]})" if close else ""
            choices = f": {', '.join(options)}" if len(options) <= 12 else f" ({len(options)} of them)"
            return f"no {group} config {name!r}{hint}; the choices are the files in configs/{group}/{choices}"
        return text.splitlines()[0]
    if isinstance(err, OverrideParseException):
        found = re.search(r"Error parsing override '([^']*)'", text)
        item = found.group(1) if found else text.splitlines()[0]
        return (f"cannot read the override {item!r}: write key=value (dotted keys, e.g. training.lr=1e-4; "
                "lists as [a,b]; quote it in the shell when it holds [ ] { } or spaces)")
    found = re.search(r"Could not override '([^']+)'", text)
    if found:
        return describe_unknown_key(_schema(config_name), found.group(1))
    found = re.search(r"An item is already at '([^']+)'", text)
    if found:
        key = found.group(1)
        return f"{key} is already in the config: set it with {key}=VALUE (no +)"
    cause = err.__cause__ or err.__context__
    detail = str(cause) if cause is not None else text
    full_key = re.search(r"full_key: (\S+)", detail)
    first = detail.splitlines()[0] if detail else type(err).__name__
    if full_key:
        return f"{full_key.group(1)}: {first}"
    return text.splitlines()[0] if text else first


def _recipe_mismatch(name: str, wanted: str, config_name: str, command: str) -> Optional[str]:
    if wanted == config_name or wanted not in RECIPES:
        return None
    kind = "an evaluation" if wanted == "evaluate" else "a training"
    return (f"experiment {name!r} is {kind} experiment (configs/experiment/{name}.yaml has recipe: {wanted}, "
            f"run by {RECIPES[wanted]}), not one for {command}: run it with `{COMMANDS[wanted]} experiment={name}`")


def compose_checked(overrides: Sequence[str], config_name: str = "sft", *, command: Optional[str] = None) -> Any:
    """:func:`compose_config`, with every failure to compose turned into one short
    :class:`OverrideError` (see :func:`explain_compose_error`).

    Args:
        command: how the user called it (``mmtune train``), named when an experiment
            belongs to the other recipe.

    Raises:
        OverrideError: an unknown key or group option, a bad value, an override that does
            not parse, or an experiment written for the other recipe.
    """
    command = command or COMMANDS.get(config_name, config_name)
    name = experiment_name(overrides)
    try:
        cfg = compose_config(overrides, config_name)
    except Exception as err:  # Hydra and OmegaConf raise many types; each becomes one line
        # a training experiment does not compose into evaluate.yaml: say so rather than why
        mismatch = _recipe_mismatch(name, experiment_recipe(overrides), config_name, command) if name else None
        raise OverrideError(mismatch or explain_compose_error(err, config_name)) from None
    if name:
        mismatch = _recipe_mismatch(name, _recipe_value(cfg), config_name, command)
        if mismatch:
            raise OverrideError(mismatch)
    return cfg


def check_recipe_overrides(argv: Sequence[str], config_name: str) -> list[str]:
    """A recipe script's command line made ready for ``@hydra.main``, after checking it.

    ``experiment=`` is normalized (:func:`normalize_overrides`), and the overrides are
    composed once so a typo stops the script with one line on stderr (exit status 2)
    rather than Hydra's exception. Hydra's own flags and ``hydra.*`` overrides are passed
    through unchecked.
    """
    import sys

    args = normalize_overrides(list(argv), config_name)
    overrides = [a for a in args if not a.startswith("-") and not a.lstrip("+~").startswith("hydra.")]
    if len(overrides) == len(args):  # with Hydra's own flags (--cfg, -m, --help) Hydra decides
        try:
            cfg = compose_checked(overrides, config_name, command=RECIPES[config_name])
            _schema_check(cfg, config_name)
        except (OverrideError, ValueError) as err:
            print(f"{RECIPES[config_name]}: {err}", file=sys.stderr)
            raise SystemExit(2) from None
    return args


def _schema_check(cfg: Any, config_name: str) -> None:
    """The typed schema's own check of a composed config (unknown ``+key``s, wrong values)."""
    if config_name == "evaluate":
        from mmtune.evaluation.config import to_evaluate_config

        to_evaluate_config(cfg)
    else:
        from mmtune.training.config import to_sft_config

        to_sft_config(cfg)


def experiment_key(experiment: str, key: str) -> Any:
    """The value experiment ``experiment`` gives ``key`` (dotted, e.g. ``training.output_dir``), resolved:
    what the resolver ``${mmtune.key_of:<experiment>,<key>}`` returns, so that an evaluation experiment
    names its training experiment's output through that experiment's own key, never a copy of the path.

    The experiment's file (``configs/experiment/<name>.yaml``) states the key or inherits it from
    the parent experiment its ``defaults`` names (as Hydra merges them: the file's own value
    wins); interpolations resolve within that file (``${oc.env:...}``).

    Raises:
        ValueError: the experiment does not exist or neither it nor its parents set ``key``.
    """
    from omegaconf import OmegaConf

    from mmtune.data.config import configs_dir

    path = Path(configs_dir()) / "experiment" / f"{experiment}.yaml"
    if not path.is_file():
        raise ValueError(f"${{mmtune.key_of:{experiment},{key}}}: no experiment {experiment!r} ({path} not found)")
    cfg = OmegaConf.load(path)
    value = OmegaConf.select(cfg, key, default=None)
    if value is not None:
        return value
    parents = [e for e in cfg.get("defaults") or [] if isinstance(e, str) and e != "_self_"]
    if not parents:
        raise ValueError(f"${{mmtune.key_of:{experiment},{key}}}: {path} sets no {key} and has no parent experiment")
    return experiment_key(parents[-1], key)


def register_resolvers() -> None:
    """Register mmtune's OmegaConf resolvers (idempotent): ``mmtune.key_of`` (:func:`experiment_key`)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("mmtune.key_of"):
        OmegaConf.register_new_resolver("mmtune.key_of", lambda experiment, key: experiment_key(str(experiment), str(key)))


# Every entry point (recipes/*.py, the mmtune commands, mmtune plan) imports this module before composing.
register_resolvers()
