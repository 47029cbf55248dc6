"""Run lmms-eval's evaluator on local tasks in a process of its own and write what it returned.

Used by test_lmms_model.py: lmms-eval changes process-wide state when it evaluates (PIL's
``LOAD_TRUNCATED_IMAGES``, filelock's lock class, ``ssl.SSLContext`` pickling), so it
runs here, not in the test process. ``python lmms_worker.py SPEC_JSON OUT_JSON``; the
spec lists runs ``{"name", "task_dir", "task", "model_args"}`` (``model_args`` null: an
InternLM-XComposer2 ``MMTuneLMM`` object built from the tiny config, passed as the model)
and ``{"expect_error": true}`` for runs that must raise.
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tiny_xc2_loader(checkpoint, config, device="auto"):
    from omegaconf import OmegaConf

    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter

    yaml = ROOT / "configs" / "model" / "internlm_xc2_tiny.yaml"
    tiny = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig()), OmegaConf.load(yaml)))
    assert config.family == "internlm_xcomposer2", config.family
    adapter = build_adapter(tiny)
    return adapter, adapter.load_model(seed=0).eval(), "tiny"


def _xc2_model():
    import lmms_eval.api.model
    import lmms_eval.models

    from mmtune.evaluation import lmms_model

    real_init = lmms_model.GenerationEngine.__init__
    lmms_model.GenerationEngine.__init__ = lambda self, *a, **k: real_init(self, *a, **k, loader=_tiny_xc2_loader)
    lmms_model.register()
    cls = lmms_eval.models.get_model("mmtune")
    assert cls is lmms_model.MMTuneLMM and issubclass(cls, lmms_eval.api.model.lmms)
    return cls(pretrained="internlm/internlm-xcomposer2-vl-7b", family="internlm_xcomposer2", device="cpu")


def main() -> None:
    from lmms_eval.evaluator import simple_evaluate
    from lmms_eval.tasks import TaskManager

    spec, out_path = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    report = {}
    xc2 = None
    for run in spec["runs"]:
        if run["model_args"] is None:
            xc2 = xc2 or _xc2_model()
            model, model_args = xc2, None
        else:
            model, model_args = "mmtune", run["model_args"]
        try:
            out = simple_evaluate(model=model, model_args=model_args, tasks=[run["task"]],
                                  task_manager=TaskManager("WARNING", include_path=run["task_dir"]), batch_size=1,
                                  log_samples=True, bootstrap_iters=0)
        except NotImplementedError as err:
            report[run["name"]] = {"error": str(err)}
            continue
        samples = sorted(out["samples"][run["task"]], key=lambda s: s["doc_id"])
        replies = [s["resps"][0][0] if isinstance(s["resps"][0], list) else s["resps"][0] for s in samples]
        report[run["name"]] = {"replies": replies, "results": out["results"][run["task"]],
                               "model": out["config"]["model"]}
    out_path.write_text(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
