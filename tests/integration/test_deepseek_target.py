"""The founding case's family on a CPU: a tiny DeepSeek-V3 target (MLA, 4 routed experts + 1 shared, the
first layer dense, weights named `language_model.…` as Kimi-K2.5 stores them) through target → extract →
train → export → verify → doctor, one fixture for the module.

The aux ids are internal [3, 4, 5]: not the default [2, …], so SGLang's DeepSeek rule (+1 only when the
first id is 1) and the Llama convention (internal − 1) disagree, and an export in the Llama convention
would be served capturing [2, 3, 4]. The dataset is `put_token_dataset`'s (datagen is the same code for
every target family and the tiny target's answers carry no signal).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from steps import export, extract, mapping, target, train, verify
from steps.lib import artifacts
from steps.lib.config import ConfigError, parse_config, resolve_aux_layer_ids
from steps.lib.diagnose import diagnose
from steps.lib.store import open_store
from tests.builders import TINY_DEEPSEEK, put_token_dataset, tiny_deepseek_dir

LAYER_IDS = [3, 4, 5]
ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_TIMEOUT_S = 900                          # two processes importing torch on a shared 2-core machine

pytestmark = pytest.mark.usefixtures("one_thread")


def deepseek_config(tdir, **extract_fields):
    return parse_config(deepseek_config_data(tdir, **extract_fields))


def deepseek_config_data(tdir, **extract_fields) -> dict:
    return {
        "name": "ds", "target": {"source": "hf_dir", "path": str(tdir)},
        "extract": {"aux_layer_ids": LAYER_IDS, "shard_tokens": 400, "batch_size": 4, "max_length": 64,
                    "disk_budget": "4MB", **extract_fields},
        "mapping": {"draft_vocab_size": 128},
        "train": {"ttt_steps": 2, "epochs": 1, "batch_tokens": 256, "max_length": 64, "checkpoint_every": 100,
                  "draft": {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                            "intermediate_size": 128}},
        "export": {"dtype": "float32"}, "verify": {"num_prompts": 2, "max_new_tokens": 8},
        "serve": {"num_steps": 2, "num_draft_tokens": 3}}


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    tdir = tiny_deepseek_dir(root)
    cfg, store = deepseek_config(tdir), open_store(f"file://{root}/store")
    target_id = target.run(cfg, store).id
    dataset_id = put_token_dataset(store, vocab_size=TINY_DEEPSEEK["vocab_size"], num_rows=12,
                                   dataset_id="d5d5d5d5d5d5d5d5")
    hidden = extract.run(cfg, store, target_id, dataset_id)
    vocab_id = mapping.run(cfg, store, dataset_id, target_id).id
    draft_id = train.run(cfg, store, target_id, hidden.id, vocab_id).id
    export_m = export.run(cfg, store, draft_id, target_id)
    verify_m = verify.run(cfg, store, export_m.id, target_id)
    return {"root": root, "tdir": tdir, "cfg": cfg, "store": store, "target_id": target_id, "hidden": hidden,
            "export": export_m, "verify": verify_m, "dataset_id": dataset_id}


def test_the_prefixed_checkpoint_loads_as_the_model_it_is(chain):
    """Without stripping `language_model.`, from_pretrained initialises every weight at random (no error)."""
    from safetensors.torch import load_file

    model, _ = artifacts.load_target(chain["store"], chain["target_id"])
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert type(model.model.layers[1].mlp).__name__ == "DeepseekV3MoE"
    saved = load_file(str(chain["tdir"] / "model.safetensors"))
    assert torch.equal(model.model.embed_tokens.weight, saved["language_model.model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, saved["language_model.lm_head.weight"])


def test_extract_captured_the_internal_layers_of_the_moe_target(chain):
    hidden = chain["hidden"]
    assert hidden.meta["layer_ids"] == LAYER_IDS and hidden.meta["computed_shards"] >= 1


def test_export_writes_the_deepseek_convention_and_sglangs_rule_captures_the_trained_layers(chain):
    from steps.lib.formats.sglang import sglang_layer_ids

    sglang_dir = artifacts.export_dir(chain["store"], chain["export"].id, "sglang")
    ids = json.loads((sglang_dir / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == LAYER_IDS                       # unshifted: the family shifts only a first id of 1
    assert sglang_layer_ids(sglang_dir, "DeepseekV3ForCausalLM") == LAYER_IDS
    assert chain["export"].meta["engines"]["sglang"]["layer_ids"] == LAYER_IDS
    assert chain["export"].meta["engines"]["vllm"]["layer_ids"] == LAYER_IDS


def test_verify_measured_tau_on_the_moe_target(chain):
    m = chain["verify"].metrics
    assert m["tau"] >= 1.0


def test_doctor_passes_the_export_against_the_moe_target(chain):
    sglang_dir = artifacts.export_dir(chain["store"], chain["export"].id, "sglang")
    findings = diagnose(sglang_dir, target=chain["tdir"])
    assert not [f for f in findings if f.status == "fail"], [str(f) for f in findings]
    f4 = next(f for f in findings if f.id == "F4")
    assert "= the trained layers [3, 4, 5]" in f4.evidence, f4


def test_internal_ids_starting_at_1_are_refused_before_extraction(chain):
    cfg = deepseek_config(chain["tdir"], aux_layer_ids=[1, 3, 5])
    with pytest.raises(ConfigError, match=r"extract.aux_layer_ids: .*DeepseekV3ForCausalLM.*start at internal 2"):
        resolve_aux_layer_ids(cfg, TINY_DEEPSEEK["num_hidden_layers"], "DeepseekV3ForCausalLM")
    with pytest.raises(ConfigError, match="cannot be served by sglang"):
        extract.run(cfg, chain["store"], chain["target_id"], chain["dataset_id"])


def test_two_gloo_ranks_holding_one_sharded_target_write_the_one_process_shards(chain, tmp_path):
    """`extract.backend: sharded` under torchrun: transformers' tensor-parallel plan splits the MoE target over
    2 CPU ranks (its MLPs and experts sharded: DTensor shards), rank 0 writes; its shards hold the states the
    1-process run wrote: bit-identical but for a few values one bf16 step apart (the float32 all-reduce's order)."""
    shutil.copytree(chain["root"] / "store", tmp_path / "store")
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(deepseek_config_data(chain["tdir"], backend="sharded")))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "steps.extract", "--config", str(tmp_path / "cfg.yaml"), "--store", f"file://{tmp_path / 'store'}",
           "--target", chain["target_id"], "--dataset", chain["dataset_id"], "--json"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "EAGLENEST_CACHE": str(tmp_path / "cache")}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-4000:]
    split = re.search(r"split over 2 ranks by transformers' tensor-parallel plan: (\d+) of (\d+) parameters",
                      out.stderr)
    assert split and 0 < int(split[1]) < int(split[2]), out.stderr[-3000:]      # really sharded, not replicated
    printed = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(printed) == 1 and printed[0]["id"] != chain["hidden"].id     # rank 0 answers; backend in the id
    sharded = open_store(f"file://{tmp_path / 'store'}").manifest("hidden", printed[0]["id"])
    one = chain["hidden"]
    assert sharded.meta["backend"] == "sharded" and sharded.meta["world_size"] == 1      # one writer
    assert [s["path"] for s in sharded.meta["shards"]] == [s["path"] for s in one.meta["shards"]]
    for s in one.meta["shards"]:
        a = load_file(str(tmp_path / "store/artifacts/hidden" / one.id / s["path"]))
        b = load_file(str(tmp_path / "store/artifacts/hidden" / sharded.id / s["path"]))
        assert set(a) == set(b)
        for k in a:
            # stored bf16: a float32 all-reduce that rounds 1e-7 differently moves a value one bf16 step (2^-8)
            torch.testing.assert_close(b[k].float(), a[k].float(), rtol=2 ** -7, atol=1e-5,
                                       msg=lambda m, k=k, p=s["path"]: f"{p} {k}: {m}")
            if a[k].is_floating_point():
                assert (a[k] == b[k]).float().mean() > 0.999, (s["path"], k)   # all but a few bit-identical
