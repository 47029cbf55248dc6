"""Local lmms-eval tasks for the tests that run lmms-eval on mmtune's model: a task YAML, a
JSON-lines file and one image per colour, written on the fly (no hub), and what mmtune's own
generator answers to the same questions."""

import json
import os
from pathlib import Path

from PIL import Image as PILImage

from mmtune.core.dialogue import Dialogue, Image, Turn
from mmtune.evaluation.generation.config import GenerationConfig
from mmtune.evaluation.generation.generator import DialogueGenerator

ROOT = Path(__file__).resolve().parents[2]
COLOURS = ("red", "green", "blue")
QUESTION = "What colour is this image? Answer with one word."
UTILS = '''
from PIL import Image


def doc_to_visual(doc):
    return [Image.open(doc["image"]).convert("RGB")]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return "<image>\\n" + doc["question"]


def process_results(doc, results):
    return {"exact_match": float(results[0].strip() == doc["answer"])}
'''
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: {output_type}
doc_to_visual: !function utils.doc_to_visual
doc_to_text: !function utils.doc_to_text
doc_to_target: answer
{extra}
"""
GENERATE = """generation_kwargs:
  max_new_tokens: 6
  temperature: 0
  until: ["{until}"]
process_results: !function utils.process_results
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true"""
CHOICE = """doc_to_choice: choices
metric_list:
  - metric: acc"""


def write_task(root: Path, name: str, answers: list[str], *, until: str = "\\n\\n", output_type: str = "generate_until"):
    """A local lmms-eval task of one image per colour; ``answers`` are the references."""
    root.mkdir(parents=True, exist_ok=True)
    docs = []
    for i, (colour, answer) in enumerate(zip(COLOURS, answers)):
        image = root / f"{colour}.png"
        PILImage.new("RGB", (40, 40), colour).save(image)
        docs.append({"id": i, "image": str(image), "question": QUESTION, "answer": answer, "choices": list(COLOURS)})
    (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / "utils.py").write_text(UTILS)
    extra = GENERATE.format(until=until) if output_type == "generate_until" else CHOICE
    (root / f"{name}.yaml").write_text(TASK.format(name=name, docs=root / "docs.jsonl", output_type=output_type,
                                                   extra=extra))
    return root, docs


def own_answers(adapter, model, docs, max_new_tokens=6):
    """mmtune's generator on the questions as the lmms-eval model asks them."""
    generator = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=max_new_tokens, device="cpu"))
    dialogues = [Dialogue(f"q{d['id']}", "t", (Turn("user", (Image(d["image"]), "\n", QUESTION)), Turn("assistant", ("",))))
                 for d in docs]
    return [r.answer for r in generator.generate(dialogues)]


def worker_env(tmp_path):
    """The environment of an lmms-eval worker process: offline, one thread, mmtune and the tests importable."""
    return {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets"), "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT),
                                                                  os.environ.get("PYTHONPATH", "")])}
