"""mmtune's own generator as an lmms-eval model named ``mmtune``.

lmms-eval ships wrappers for the Hugging Face LLaVA classes but none that runs
InternLM-XComposer2 the way mmtune does (natively, no remote code). This module lets
lmms-eval run any model mmtune can load, with the same chat template, image handling
and decoding as mmtune's own benchmarks:

* :class:`GenerationEngine` loads the model (:func:`~mmtune.evaluation.generation.loading.load_for_evaluation`)
  and answers one lmms-eval request: context text + the document's images + the task's
  generation settings (``max_new_tokens``, ``temperature``, ``top_p``, ``until``);
* ``MMTuneLMM`` (built on first access, so importing this module needs no lmms-eval)
  subclasses lmms-eval's model base ``lmms_eval.api.model.lmms`` and implements
  ``generate_until`` over the engine; log-likelihood requests are refused with a message;
* :func:`register` adds the model to a running lmms-eval (model registry v2 of
  lmms-eval >= 0.4, or the older ``register_model`` decorator); :func:`manifest` is the
  payload for lmms-eval's ``lmms_eval.models`` entry-point group;
* ``python -m mmtune.evaluation.lmms_model <lmms-eval arguments>`` registers the model
  and hands over to lmms-eval's own command line. :func:`~mmtune.evaluation.benchmarks.lmms_eval.build_command`
  writes that command when ``model_type`` is ``mmtune``.

Model arguments (``--model_args``): ``pretrained`` (a directory mmtune saved, a local HF
model or a hub id), ``family``, optional ``model_config`` (a JSON file of mmtune's
ModelConfig, written by the runner so lmms-eval loads the model exactly as mmtune did)
and ``device``.

Tested against lmms-eval 0.7.3 itself (its ``simple_evaluate`` and its command line on a
local task). Its evaluator imports ``filelock._api``, which filelock 4 renamed
``filelock._core``; :func:`manifest`, :func:`register` and :func:`main` alias the old name
when only the new one exists, so lmms-eval runs with either filelock.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

__all__ = ["MODEL_ID", "GenerationEngine", "manifest", "register", "main"]

MODEL_ID = "mmtune"
_CLASS_PATH = "mmtune.evaluation.lmms_model.MMTuneLMM"


class GenerationEngine:
    """Loads a model once and answers single-turn requests with mmtune's generator.

    Args:
        pretrained: a directory mmtune saved (run dir, ``final/``, adapter), a local HF
            model directory or a hub id.
        family: model family (``llava``, ``internlm_xcomposer2``).
        model_config: JSON file of a ModelConfig (dtype, image size, architecture ...).
        loader: injected in tests; defaults to ``load_for_evaluation``.
    """

    def __init__(self, pretrained: str, family: str = "llava", model_config: Optional[str] = None,
                 device: str = "auto", loader: Optional[Callable[..., Any]] = None):
        from mmtune.models.config import ModelConfig

        values = json.loads(Path(model_config).read_text()) if model_config else {}
        fields = ModelConfig.field_names()  # the common keys and every family's section
        config = ModelConfig.from_dict({k: v for k, v in values.items() if k in fields})
        config = dataclasses.replace(config, family=family, path=pretrained)
        if loader is None:
            from mmtune.evaluation.generation.loading import load_for_evaluation as loader
        # a directory mmtune can resolve (run dir, final/, adapter, HF dir) is a checkpoint;
        # a hub id is a model path
        checkpoint = pretrained if Path(pretrained).is_dir() else None
        self.adapter, self.model, self.label = loader(checkpoint, config, device=device)
        self.device = device
        self._generators: dict[str, Any] = {}
        self._images = tempfile.mkdtemp(prefix="mmtune_lmms_")
        self._count = 0

    def _generator(self, gen_kwargs: dict[str, Any]):
        import json

        from mmtune.evaluation.generation.config import GenerationConfig
        from mmtune.evaluation.generation.generator import DialogueGenerator

        temperature = float(gen_kwargs.get("temperature", 0.0) or 0.0)
        settings = GenerationConfig(
            max_new_tokens=int(gen_kwargs.get("max_new_tokens", 128)),
            do_sample=bool(gen_kwargs.get("do_sample", False)) or temperature > 0,
            temperature=temperature if temperature > 0 else 1.0,
            top_p=float(gen_kwargs.get("top_p", 1.0) or 1.0),
            device=self.device,
        )
        key = json.dumps(dataclasses.asdict(settings), sort_keys=True)  # settings hold a dict: hash their JSON
        if key not in self._generators:
            self._generators[key] = DialogueGenerator(self.adapter, self.model, settings)
        return self._generators[key]

    def _image_paths(self, visuals: Sequence[Any]) -> list[str]:
        paths = []
        for visual in visuals:
            if isinstance(visual, (str, os.PathLike)):
                paths.append(str(visual))
                continue
            if not hasattr(visual, "save"):
                raise ValueError(f"lmms-eval passed a visual of type {type(visual).__name__}; mmtune's model takes images only")
            self._count += 1
            path = os.path.join(self._images, f"{self._count}.png")
            visual.convert("RGB").save(path)
            paths.append(path)
        return paths

    def answer(self, context: str, visuals: Sequence[Any], gen_kwargs: Optional[dict[str, Any]] = None) -> str:
        """The model's reply to ``context`` about ``visuals``, cut at the first ``until`` string."""
        from mmtune.data.dialogue import Dialogue, Image, Turn

        gen_kwargs = dict(gen_kwargs or {})
        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        images = tuple(Image(p) for p in self._image_paths(visuals))
        text = context.replace("<image>", "").strip()  # mmtune's template places the images itself
        segments = (*images, "\n", text) if images else (text,)
        self._count += 1
        dialogue = Dialogue(f"lmms-{self._count}", "lmms_eval", (Turn("user", segments), Turn("assistant", ("",))))
        (record,) = self._generator(gen_kwargs).generate([dialogue])
        reply = record.answer or ""
        for stop in until:
            if stop and stop in reply:
                reply = reply[: reply.index(stop)]
        return reply


def _build_class() -> type:
    from lmms_eval.api.model import lmms

    class MMTuneLMM(lmms):
        """lmms-eval model ``mmtune``: mmtune's generator behind lmms-eval's model interface."""

        def __init__(self, pretrained: str, family: str = "llava", model_config: Optional[str] = None,
                     device: str = "auto", batch_size: Any = 1, **unused: Any):
            super().__init__()
            self.engine = GenerationEngine(pretrained, family, model_config, device)
            self._rank, self._world_size = 0, 1
            self.batch_size_per_gpu = int(batch_size)

        def generate_until(self, requests) -> list[str]:
            replies = []
            for request in requests:
                context, gen_kwargs, doc_to_visual, doc_id, task, split = request.args
                visuals = doc_to_visual(self.task_dict[task][split][doc_id]) if doc_to_visual else []
                replies.append(self.engine.answer(context, [v for v in (visuals or []) if v is not None], gen_kwargs))
            return replies

        def loglikelihood(self, requests):
            raise NotImplementedError(
                "the mmtune lmms-eval model answers generation tasks only; choose the task's generate_until "
                "variant or evaluate log-likelihood tasks with a Hugging Face wrapper such as llava_hf"
            )

        def generate_until_multi_round(self, requests):
            raise NotImplementedError("multi-round lmms-eval tasks are not supported by the mmtune model; "
                                      "mmtune's own MMDU benchmark evaluates multi-turn dialogue")

    MMTuneLMM.__module__ = __name__
    return MMTuneLMM


def __getattr__(name: str) -> Any:
    if name == "MMTuneLMM":
        cls = _build_class()
        globals()["MMTuneLMM"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _filelock_compat() -> None:
    """Let lmms-eval's evaluator (``import filelock._api``) run with filelock 4 (``filelock._core``)."""
    import importlib.util

    if importlib.util.find_spec("filelock._api") is None and importlib.util.find_spec("filelock._core") is not None:
        import filelock._core

        if hasattr(filelock._core, "FileLockMeta"):  # the class lmms-eval patches
            sys.modules.setdefault("filelock._api", filelock._core)


def manifest() -> Any:
    """lmms-eval's ModelManifest for ``mmtune`` (entry-point group ``lmms_eval.models``)."""
    from lmms_eval.models.registry_v2 import ModelManifest

    _filelock_compat()  # lmms-eval reads its entry points before it runs an evaluation

    return ModelManifest(model_id=MODEL_ID, simple_class_path=_CLASS_PATH)


def register() -> None:
    """Make ``--model mmtune`` resolvable in this process's lmms-eval."""
    from lmms_eval import models

    _filelock_compat()

    registry = getattr(models, "MODEL_REGISTRY_V2", None)
    if registry is not None:
        registry.register_manifest(manifest(), overwrite=True)
        available = getattr(models, "AVAILABLE_MODELS", None)
        if isinstance(available, dict):
            available[MODEL_ID] = "MMTuneLMM"
        return
    from lmms_eval.api.registry import register_model  # lmms-eval < 0.4

    register_model(MODEL_ID)(__getattr__("MMTuneLMM"))


def main(argv: Optional[list[str]] = None) -> None:
    """Register ``mmtune`` and run lmms-eval's command line with ``argv``."""
    register()
    sys.argv = ["lmms_eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        from lmms_eval.cli.dispatch import main as lmms_main
    except ImportError:  # lmms-eval < 0.5: no subcommand dispatcher
        from lmms_eval.__main__ import cli_evaluate as lmms_main
    lmms_main()


if __name__ == "__main__":
    main()
