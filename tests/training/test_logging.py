"""Secret redaction, MFU, and W&B offline logging of the resolved config."""

import json

import pytest

from mmtune.training.config import LoggingConfig
from mmtune.training.logging import RunLogger, mfu, peak_flops, redact


def test_redact_hides_secret_strings_only():
    config = {"judge": {"api_key": "sk-123", "api_key_env": "MMTUNE_JUDGE_API_KEY", "max_tokens": 2048},
              "hub_token": "hf_abc", "db_password": "pw", "client_secret": "s", "lr": 1e-4,
              "sources": [{"name": "x", "auth_token": "t"}]}
    out = redact(config)
    assert out["judge"]["api_key"] == out["hub_token"] == out["db_password"] == out["client_secret"] == "***"
    assert out["sources"][0]["auth_token"] == "***"
    assert out["judge"]["max_tokens"] == 2048 and out["lr"] == 1e-4 and out["sources"][0]["name"] == "x"


def test_mfu_uses_peak_of_the_device():
    assert peak_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989e12)
    assert mfu(7_000_000_000, 3000.0, "NVIDIA A100-SXM4-80GB") == pytest.approx(6 * 7e9 * 3000 / 312e12)
    assert mfu(7_000_000_000, 3000.0, "NVIDIA A100-SXM4-80GB", num_devices=8) == pytest.approx(6 * 7e9 * 3000 / 312e12 / 8)
    assert mfu(1000, 10.0, "cpu") is None


def test_wandb_offline_run_gets_redacted_config_and_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LoggingConfig(wandb=True, project="mmtune-test", tags=["unit"], progress_bar=False)
    logger = RunLogger(cfg, output_dir=str(tmp_path), is_main=True, total_steps=2,
                       resolved_config={"training": {"lr": 0.1}, "judge": {"api_key": "sk-SECRET"}})
    logger.log(1, {"train/loss": 1.5, "train/lr": 0.1})
    logger.close()
    runs = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert runs, "no offline W&B run was written"
    record = runs[0].read_bytes()  # the run's protobuf records, config included
    assert b'api_key":"***"' in record and b'"lr":0.1' in record
    every_file = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    assert b"sk-SECRET" not in every_file
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics == [{"step": 1, "train/loss": 1.5, "train/lr": 0.1}]
