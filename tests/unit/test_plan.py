"""`eaglenest plan`: every config in configs/ plans; the founding config's refusals (one line, exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from steps import plan

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
FOUNDING = next(p for p in CONFIGS if p.name == "moe-7168.yaml")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_plans(path, capsys):
    assert plan.main(["--config", str(path), "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["tokens"] > 0 and p["rounds"] >= 1 and p["object_store_bytes"] > 0
    assert p["hidden_bytes"]["float8_e4m3fn"] < p["hidden_bytes"]["bfloat16"]
    assert p["hours"]["extract"] > 0 and p["hours"]["train"] > 0
    assert all(r["source"] for r in p["rates"].values())


def test_the_founding_node_plans_the_sharded_backend(capsys):
    assert plan.main(["--config", str(FOUNDING), "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["target"] == {"hidden_size": 7168, "num_hidden_layers": 61, "num_aux": 3}
    assert p["bytes_per_token"] == {"bfloat16": 57_353, "float8_e4m3fn": 28_689}   # 4 × 7168 × 2 (+ ids, mask)
    assert p["rounds"] == 94 and p["rates"]["extract"]["backend"] == "sharded"
    assert p["rates"]["extract"]["tok_per_s"] == pytest.approx(1e9 / 57_353)          # bounded by one writer


def refused(tmp_path, capsys, **extract) -> str:
    data = yaml.safe_load(FOUNDING.read_text())
    data["extract"].update(extract)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    assert plan.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"eaglenest plan: {path}: extract.")
    return err


def test_a_disk_budget_that_cannot_hold_one_shard_is_refused(tmp_path, capsys):
    assert "cannot hold one shard" in refused(tmp_path, capsys, disk_budget="3GB")   # a shard is ≤ 3.76 GB


def test_a_local_backend_for_a_tp8_target_is_refused(tmp_path, capsys):
    assert "extract.backend=sharded" in refused(tmp_path, capsys, backend="local")


def test_the_sglang_server_path_is_refused_naming_the_faster_backend(tmp_path, capsys):
    err = refused(tmp_path, capsys, backend="sglang", server_url="http://a:1", final_server_url="http://a:2")
    assert "two servers" in err and "2 × TP=8" in err and "extract.backend=sharded" in err


def test_the_sglang_runner_backend_plans_bounded_by_one_writer(tmp_path, capsys):
    data = yaml.safe_load(FOUNDING.read_text())
    data["extract"]["backend"] = "sglang_runner"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    assert plan.main(["--config", str(path), "--json"]) == 0
    rate = json.loads(capsys.readouterr().out)["rates"]["extract"]
    assert rate["backend"] == "sglang_runner" and rate["tok_per_s"] == pytest.approx(1e9 / 57_353)
    assert rate["source"].startswith("not measured on GPUs: bounded by one shard writer")
