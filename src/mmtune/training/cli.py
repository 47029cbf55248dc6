"""``mmtune train``: fine-tune on a config or straight on your own data files, then say
where the checkpoint is and which command evaluates it.

    mmtune train model=llava_tiny 'data.files=[mydata/chat.json,mydata/dialogues.jsonl]'
    mmtune train model=llava_tiny 'data.files=[a.json,b.jsonl]' 'data.ratios=[3,1]' data.image_root=imgs
    mmtune train experiment=table3_llava15_7b_mmdu45k
    accelerate launch --config_file launch/accelerate/single_node_8gpu_zero3.yaml -m mmtune train ...

Arguments are Hydra overrides of configs/sft.yaml, as for recipes/sft.py (which takes
the same ones). ``data.files`` makes each file one source, its format detected as
``mmtune data check FILE`` detects it (docs/own_data.md walks through a run). A typo in
a key stops the command at once with the closest known key (exit status 2).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

__all__ = ["evaluate_command", "report_command", "refusals", "main"]


def refusals() -> tuple[type[BaseException], ...]:
    """The errors a training run stops with as one message (exit status 2), not a traceback.

    Problems of the user's files, folders, launch or config (not of mmtune): found at set-up,
    or by the evaluation before training (a held-out file with bad records). Resume refusals
    too: a changed config or data file (ResumeConfigError), a used folder not resumed
    (FileExistsError), an incomplete or damaged checkpoint (a FileNotFoundError), a symbolic
    link where an output file goes (OutputLinkError); a launch the engine cannot run under;
    a hostile model folder; and a run stopped by a non-finite loss. ``recipes/sft.py``
    answers the same ones alike.
    """
    from mmtune.data.validation import DataValidationError
    from mmtune.evaluation.benchmarks.common import BenchmarkDataError
    from mmtune.io.locks import DirectoryLockedError
    from mmtune.io.nofollow import OutputLinkError
    from mmtune.models.checkpoint_guard import ModelFileError
    from mmtune.training.checkpoint import ResumeConfigError
    from mmtune.training.config import ConfigError
    from mmtune.training.engines import EngineLaunchError
    from mmtune.training.nonfinite import NonFiniteTrainingError

    return (DataValidationError, BenchmarkDataError, DirectoryLockedError, FileNotFoundError, FileExistsError,
            ResumeConfigError, OutputLinkError, ConfigError, EngineLaunchError, ModelFileError,
            NonFiniteTrainingError)


def _changed_settings(settings: Any) -> dict[str, Any]:
    """The scalar fields of a benchmark's settings that differ from their defaults."""
    default = type(settings)()
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)
            if f.name != "predictions" and getattr(settings, f.name) != getattr(default, f.name)}


def evaluate_command(cfg: Any, final_dir: str | os.PathLike) -> tuple[str, bool]:
    """The ``mmtune evaluate`` command for ``final_dir``, and whether it can run as printed.

    The first benchmark of ``cfg.eval`` whose data file is set (and that mmtune answers
    itself) is used with that file; without one, the ``heldout`` benchmark with a
    placeholder for your held-out file. Answers go to ``<output_dir>/eval/after``, beside
    ``eval/before`` (``training.eval_before``), or to ``eval/final`` when training already
    evaluated ``final/`` into ``eval/after``.
    """
    from mmtune.evaluation.benchmarks.registry import get_benchmark
    from mmtune.evaluation.cli import checkpoint_command

    out = Path(cfg.training.output_dir) / "eval" / ("final" if cfg.training.eval_after else "after")
    run = cfg.run_name or Path(cfg.training.output_dir).name  # the label training's own evaluations carry
    for name in cfg.eval.benchmarks:
        bench = get_benchmark(name)
        settings = getattr(cfg.eval, name, None)
        if bench.generates and getattr(settings, "data_path", None):
            return checkpoint_command(str(final_dir), name, _changed_settings(settings), str(out), run), True
    return checkpoint_command(str(final_dir), "heldout", {"data_path": "YOUR_HELD_OUT.jsonl"}, str(out), run), False


def report_command(cfg: Any) -> str:
    """``mmtune report`` over this run's folder (loss curves, scores before and after, viewers)."""
    import shlex

    out = Path(cfg.training.output_dir)
    return shlex.join(["mmtune", "report", "--results", str(out), "--out", str(out / "report")])


def _threads_line() -> Optional[str]:
    """Set the CPU threads of a one-process CPU run; launchers of several processes set their own."""
    import torch

    if torch.cuda.is_available() or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return None
    from mmtune.training.cpu import set_cpu_threads

    return set_cpu_threads()


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    from omegaconf import OmegaConf

    from mmtune.compose import OverrideError, compose_checked
    from mmtune.training.config import ConfigError, apply_data_files, to_sft_config

    try:
        raw = compose_checked(argv, "sft", command="mmtune train")
        stated = apply_data_files(raw)
        cfg = to_sft_config(raw)
    except (OverrideError, ConfigError, ValueError) as err:
        print(f"mmtune train: {err}", file=sys.stderr)
        return 2
    threads = _threads_line()
    main_process = int(os.environ.get("RANK", "0")) == 0
    if main_process:
        for line in stated + ([threads] if threads else []):
            print(f"mmtune train: {line}", flush=True)

    from mmtune.training.loop import SFTRecipe

    started = time.perf_counter()
    recipe = SFTRecipe(cfg, resolved_config=OmegaConf.to_container(raw, resolve=True))
    try:  # expected refusals are one message (see refusals())
        recipe.setup()
        recipe.train()
        final_dir = recipe.save()
    except refusals() as err:
        print(f"mmtune train: {err}", file=sys.stderr)
        return 2
    recipe.cleanup()
    if not recipe.accelerator.is_main_process:
        return 0
    minutes = (time.perf_counter() - started) / 60
    print(f"\nmmtune train: done, {recipe.step} optimizer steps in {minutes:.1f} min")
    print(f"  run folder:   {cfg.training.output_dir} (metrics.jsonl, data_report.json)")
    if final_dir is None:
        print("  no final/ written (training.save_final=false)")
        return 0
    print(f"  checkpoint:   {final_dir}")
    for tag in ("before", "after"):
        viewer = Path(cfg.training.output_dir) / "eval" / tag / "viewer.html"
        if tag in recipe.eval_results and viewer.is_file():
            print(f"  eval {tag:<7} {viewer}")
    command, ready = evaluate_command(cfg, final_dir)
    print(f"  evaluate it:  {command}")
    if not ready:
        print("                (YOUR_HELD_OUT.jsonl: dialogues kept out of training, in any format data.files takes; "
              "or set eval=heldout eval.heldout.data_path=... for training to evaluate them itself)")
    print(f"  then report:  {report_command(cfg)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
