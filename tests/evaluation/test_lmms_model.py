"""mmtune's generator behind lmms-eval's model interface, checked against a stand-in of
lmms-eval's documented API (lmms-eval itself is an optional extra and not installed in CI):
the ``lmms_eval.api.model.lmms`` base class with ``generate_until`` / ``loglikelihood`` /
``generate_until_multi_round``, requests whose ``args`` are
``(context, gen_kwargs, doc_to_visual, doc_id, task, split)``, the ``task_dict`` the
evaluator sets on the model, and the v2 model registry with ``ModelManifest``."""

import abc
import dataclasses
import importlib
import sys
import types
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from PIL import Image as PILImage

from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_lmms_eval(monkeypatch):
    api_model = types.ModuleType("lmms_eval.api.model")

    class lmms(abc.ABC):  # noqa: N801 (lmms-eval's name)
        def __init__(self):
            self._rank, self._world_size = 0, 1

        @abc.abstractmethod
        def loglikelihood(self, requests): ...

        @abc.abstractmethod
        def generate_until(self, requests): ...

        @abc.abstractmethod
        def generate_until_multi_round(self, requests): ...

    api_model.lmms = lmms
    registry_v2 = types.ModuleType("lmms_eval.models.registry_v2")

    @dataclasses.dataclass(frozen=True)
    class ModelManifest:
        model_id: str
        simple_class_path: str = None
        chat_class_path: str = None
        aliases: tuple = ()

    registry_v2.ModelManifest = ModelManifest

    class Registry:
        def __init__(self):
            self.manifests = {}

        def register_manifest(self, manifest, *, overwrite=False):
            self.manifests[manifest.model_id] = manifest

        def get_model_class(self, name):
            module, _, cls = self.manifests[name].simple_class_path.rpartition(".")
            return getattr(importlib.import_module(module), cls)

    models = types.ModuleType("lmms_eval.models")
    models.MODEL_REGISTRY_V2 = Registry()
    models.AVAILABLE_MODELS = {}
    package, api = types.ModuleType("lmms_eval"), types.ModuleType("lmms_eval.api")
    package.models, package.api, api.model = models, api, api_model
    for name, module in {"lmms_eval": package, "lmms_eval.api": api, "lmms_eval.api.model": api_model,
                         "lmms_eval.models": models, "lmms_eval.models.registry_v2": registry_v2}.items():
        monkeypatch.setitem(sys.modules, name, module)
    import mmtune.evaluation.lmms_model as module

    monkeypatch.delitem(module.__dict__, "MMTuneLMM", raising=False)  # rebuild against this stand-in
    return models


def _tiny_xc2_loader(checkpoint, config, device="auto"):
    yaml = ROOT / "configs" / "model" / "internlm_xc2_tiny.yaml"
    tiny = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(yaml)))
    assert config.family == "internlm_xcomposer2" and config.path == "internlm/internlm-xcomposer2-vl-7b"
    adapter = build_adapter(tiny)
    return adapter, adapter.load_model(seed=0).eval(), "tiny"


@dataclasses.dataclass
class Request:
    args: tuple


def test_registered_model_answers_generation_requests_for_xcomposer2(fake_lmms_eval, monkeypatch):
    from mmtune.evaluation import lmms_model

    lmms_model.register()
    cls = fake_lmms_eval.MODEL_REGISTRY_V2.get_model_class("mmtune")
    assert cls.__name__ == "MMTuneLMM" and issubclass(cls, sys.modules["lmms_eval.api.model"].lmms)
    assert fake_lmms_eval.AVAILABLE_MODELS["mmtune"] == "MMTuneLMM"

    real_init = lmms_model.GenerationEngine.__init__
    monkeypatch.setattr(lmms_model.GenerationEngine, "__init__",
                        lambda self, *a, **k: real_init(self, *a, **k, loader=_tiny_xc2_loader))
    model = cls(pretrained="internlm/internlm-xcomposer2-vl-7b", family="internlm_xcomposer2", batch_size="1")
    image = PILImage.new("RGB", (56, 56), (200, 30, 30))
    model.task_dict = {"mmstar": {"val": {0: {"image": image}, 1: {"image": image}}}}
    visual = lambda doc: [doc["image"]]  # noqa: E731
    requests = [Request(("<image>\nWhat colour is it?", {"max_new_tokens": 5, "temperature": 0}, visual, 0, "mmstar", "val")),
                Request(("Describe.", {"max_new_tokens": 5, "until": ["\n\n"]}, visual, 1, "mmstar", "val"))]
    replies = model.generate_until(requests)
    assert len(replies) == 2 and all(isinstance(r, str) for r in replies)

    # `until` cuts the reply at its first stop string; greedy decoding repeats the same reply
    full = model.engine.answer("Describe.", [image], {"max_new_tokens": 8})
    if len(full) >= 3:
        stop = full[1:3]
        assert model.engine.answer("Describe.", [image], {"max_new_tokens": 8, "until": [stop]}) == full[: full.index(stop)]
    with pytest.raises(NotImplementedError, match="generation tasks only"):
        model.loglikelihood(requests)


def test_launcher_command_for_xcomposer2():
    from mmtune.evaluation.benchmarks.lmms_eval import LmmsEvalConfig
    from mmtune.evaluation.benchmarks.lmms_eval import build_command

    cmd = build_command("/runs/xc2/final", LmmsEvalConfig(tasks=["mmstar"]), family="internlm_xcomposer2",
                        output_path="/o", python="python", model_config_file="/o/mmtune_model.json")
    assert cmd[:5] == ["python", "-m", "mmtune.evaluation.lmms_model", "--model", "mmtune"]
    assert cmd[cmd.index("--model_args") + 1] == "pretrained=/runs/xc2/final,family=internlm_xcomposer2,model_config=/o/mmtune_model.json"
