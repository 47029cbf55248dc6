"""Launch files (``launch/accelerate/*.yaml``) read once, and checked against the run's engine in one place.

``training.backend.engine`` chooses the engine; an experiment's ``launcher`` key names the
accelerate config its command launches with. :func:`launcher_problem` is the one check
that the two agree (the engine reads the launch file: its ``launch_config_problem``), run
when the config is validated (so an experiment cannot name two that disagree) and by
``mmtune plan`` for a launcher given on its command line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

__all__ = ["LaunchFileError", "resolve_launch_file", "launch_config", "launcher_processes", "launcher_problem"]


class LaunchFileError(FileNotFoundError):
    """A launch file (or a file it names) is not found; the message names both places tried."""


def resolve_launch_file(path: str, what: str = "accelerate config") -> str:
    """A launch file as given when it exists from the current folder, else the same
    relative path under the project (where ``launch/`` lives), as the README's commands
    name them from the repository root.

    Raises:
        LaunchFileError: neither exists (both places named).
    """
    from mmtune.data.config import configs_dir

    if os.path.isfile(path):
        return path
    project = Path(configs_dir()).resolve().parent / path
    if not os.path.isabs(path) and project.is_file():
        return str(project)
    tried = f"{os.path.abspath(path)}" + ("" if os.path.isabs(path) else f" or {project}")
    raise LaunchFileError(f"{what} {path!r} not found (tried {tried})")


def launch_config(accelerate_config: str) -> dict[str, Any]:
    """An accelerate config file as a dict, what an engine's ``launch_config_problem`` reads.

    Raises:
        LaunchFileError: the file is not found.
    """
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(resolve_launch_file(accelerate_config))) or {}  # type: ignore[return-value]


def launcher_processes(accelerate_config: str) -> Optional[int]:
    """GPUs an accelerate config launches (``num_processes``), or None when it does not say."""
    processes = launch_config(accelerate_config).get("num_processes")
    return int(processes) if isinstance(processes, int) and processes > 0 else None


def launcher_problem(backend: Any, accelerate_config: str, origin: Optional[str] = None) -> str:
    """Why the accelerate config ``accelerate_config`` cannot start the engine ``backend`` chooses
    (``training.backend``: its ``engine`` and that engine's section); empty when it can.

    Args:
        origin: how the file is named in the message (default: its path).

    Raises:
        LaunchFileError: the launch file, or a file it names, is not found.
    """
    from mmtune.training.engines import engine_class

    engine = engine_class(backend.engine)
    shown = origin or str(accelerate_config)
    return engine.launch_config_problem(
        getattr(backend, backend.engine), launch_config(accelerate_config), shown,
        resolve=lambda path: resolve_launch_file(path, f"file {shown} names"))
