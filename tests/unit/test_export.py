"""Export: one draft artifact → strictly checked SGLang and vLLM directories, or no artifact at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from steps import export
from steps.lib import artifacts
from steps.lib.checks import strict
from steps.lib.formats.sglang_loader import load_sglang_draft
from steps.lib.store import ArtifactError, open_store
from tests.builders import (
    CANONICAL_DRAFT_KEYS,
    SPECULATORS_DRAFT_KEYS,
    put_random_draft,
    tiny_pipeline_config,
    tiny_target_dir,
)

V, H, VD = 272, 64, 128
LAYER_IDS = [1, 2, 3]


def hf_target_dir(root: Path) -> Path:
    return tiny_target_dir(root, vocab_size=V, hidden_size=H, intermediate_size=128)


def pipeline_config(target_dir: Path, **sections):
    return tiny_pipeline_config(target_dir, draft_vocab_size=VD, layer_ids=LAYER_IDS, **sections)


def put_draft(store, target_dir: Path, **kw) -> str:
    """A seeded random draft artifact as train writes it (kw: num_aux, layer_ids, seed)."""
    return put_random_draft(store, target_dir, draft_vocab_size=VD, intermediate_size=128, **kw)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from steps import target

    root = tmp_path_factory.mktemp("export")
    tdir = hf_target_dir(root)
    store = open_store(f"file://{root}/store")
    cfg = pipeline_config(tdir)
    return {"root": root, "tdir": tdir, "store": store, "cfg": cfg, "target_id": target.run(cfg, store).id,
            "draft_id": put_draft(store, tdir)}


def test_export_writes_both_engines_with_their_layer_ids_and_passes_the_checker(world):
    m = export.run(world["cfg"], world["store"], world["draft_id"], world["target_id"])
    assert m.kind == "export" and m.inputs == {"draft": world["draft_id"], "target": world["target_id"]}
    assert m.meta["engines"]["sglang"]["layer_ids"] == [0, 1, 2]
    assert m.meta["engines"]["vllm"]["layer_ids"] == [1, 2, 3]
    assert m.metrics["num_keys"] == {"sglang": 16, "vllm": 16}
    assert {f["path"] for f in m.files} == {"sglang/config.json", "sglang/model.safetensors",
                                            "vllm/config.json", "vllm/model.safetensors"}
    # the written names against the hand-written sets (the strict checker below reads steps.lib.formats' own tables)
    expected_keys = {"sglang": CANONICAL_DRAFT_KEYS, "vllm": SPECULATORS_DRAFT_KEYS}
    for engine in ("sglang", "vllm"):
        path = artifacts.export_dir(world["store"], m.id, engine)
        assert strict.check_engine_dir(path, engine, expect={"layer_ids": LAYER_IDS, "vocab_size": V}) == []
        weights = load_file(str(path / "model.safetensors"))
        assert set(weights) == expected_keys[engine]
        assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
        assert weights["fc.weight"].shape == (H, 3 * H) and weights["lm_head.weight"].shape == (VD, H)
        assert weights["embed_tokens.weight"].shape == (V, H)
        assert weights["d2t"].shape == (VD,) and weights["t2d"].shape == (V,)
    assert export.run(world["cfg"], world["store"], world["draft_id"], world["target_id"]).id == m.id


def test_an_exported_sglang_dir_serves_the_trained_weights(world):
    from steps.lib.artifacts import load_draft

    m = export.run(world["cfg"], world["store"], world["draft_id"], world["target_id"])
    draft, _ = load_draft(world["store"], world["draft_id"])
    loaded, report = load_sglang_draft(artifacts.export_dir(world["store"], m.id, "sglang"))
    assert report.dropped == [] and report.missing == []
    ids, hidden = torch.randint(0, V, (1, 5)), torch.randn(1, 5, 3 * H)
    with torch.no_grad():
        assert torch.equal(loaded(ids, hidden, torch.arange(5)[None])[0], draft(ids, hidden, torch.arange(5)[None])[0])


def test_max_position_embeddings_comes_from_the_target_context_not_the_draft(world):
    cfg = pipeline_config(world["tdir"], target={"source": "hf_dir", "path": str(world["tdir"]),
                                                 "context_length": 4096})
    m = export.run(cfg, world["store"], world["draft_id"], world["target_id"])
    sg = json.loads((artifacts.export_dir(world["store"], m.id, "sglang") / "config.json").read_text())
    vl = json.loads((artifacts.export_dir(world["store"], m.id, "vllm") / "config.json").read_text())
    assert sg["max_position_embeddings"] == vl["transformer_layer_config"]["max_position_embeddings"] == 4096
    assert m.meta["draft_max_position_embeddings"] == 512


def test_a_draft_whose_fc_width_disagrees_with_its_layer_ids_leaves_no_artifact(world):
    bad = put_draft(world["store"], world["tdir"], num_aux=2, seed=1)       # fc reads 2 aux, ids name 3
    with pytest.raises(strict.FormatError, match="fc.weight"):
        export.run(world["cfg"], world["store"], bad, world["target_id"])
    exported_inputs = [world["store"].manifest("export", i).inputs["draft"] for i in world["store"].list("export")]
    assert bad not in exported_inputs


def test_layer_ids_the_engines_cannot_capture_are_refused(world):
    bad = put_draft(world["store"], world["tdir"], layer_ids=[1, 2, 4], seed=2)   # 4 = the last layer's output
    with pytest.raises(ValueError, match="cannot be captured"):
        export.run(world["cfg"], world["store"], bad, world["target_id"])


def test_export_dir_names_the_missing_engine(world):
    cfg = pipeline_config(world["tdir"], export={"engines": ["sglang"], "dtype": "float32"})
    m = export.run(cfg, world["store"], world["draft_id"], world["target_id"])
    with pytest.raises(ArtifactError, match="has no .vllm. directory"):
        artifacts.export_dir(world["store"], m.id, "vllm")


def test_the_cli_prints_the_export_id(world, tmp_path, capsys):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump(world["cfg"].model_dump(mode="json")))
    rc = export.main(["--config", str(cfg_file), "--store", world["store"].uri, "--draft", world["draft_id"],
                      "--target", world["target_id"], "--json"])
    out = json.loads(capsys.readouterr().out)["id"]
    assert rc == 0 and world["store"].exists("export", out)
