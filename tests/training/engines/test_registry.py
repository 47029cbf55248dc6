"""The engines' registry: found like the families and formats, and blind to the run's whole config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[3] / "src"
ENGINES = SRC / "mmtune" / "training" / "engines"


def test_importing_the_engines_does_not_import_the_training_config():
    code = ("import sys, mmtune.training.engines as e; names = e.engine_names(); "
            "print(','.join(names)); print('mmtune.training.config' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    names, imported_config = out.split()
    assert set(names.split(",")) >= {"ddp", "deepspeed", "fsdp2"}
    assert imported_config == "False"


def test_no_engine_module_imports_the_runs_config():
    import ast

    for module in ENGINES.glob("*.py"):
        text = module.read_text(encoding="utf-8")
        imported = {node.module for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Import)
                     for alias in node.names}
        assert "mmtune.training.config" not in imported and "SFTConfig" not in text, module.name


def test_every_module_of_the_package_registers_without_a_list(tmp_path, monkeypatch):
    """The registry imports the package's modules (core/plugins): each module's engine registers itself."""
    from mmtune.training.engines import engine_class, engine_names

    for name in engine_names():
        cls = engine_class(name)
        assert cls.__module__ == f"mmtune.training.engines.{cls.__module__.rsplit('.', 1)[1]}"
    assert "ddp, deepspeed, fsdp2" not in (ENGINES / "__init__.py").read_text(encoding="utf-8").split('"""')[2]


def test_an_engine_is_built_from_its_own_section_and_the_context():
    from mmtune.training.config import SFTConfig, engine_context, run_engine

    cfg = SFTConfig()
    cfg.training.backend.engine = "deepspeed"
    cfg.training.max_grad_norm = 0.5
    engine = run_engine(cfg)
    assert engine.config is cfg.training.backend.deepspeed or engine.config == cfg.training.backend.deepspeed
    assert engine.context == engine_context(cfg) and engine.context.max_grad_norm == 0.5
    assert not hasattr(engine, "cfg")
