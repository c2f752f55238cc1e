"""Online hidden states (train.hidden_states=online): the target inside the training job gives the same
shards, the same batches and the same loss curve as extract → train, writes no hidden artifact, and a
killed online run resumes to the weights of an uninterrupted one."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from steps.extract import run as extract
from steps.lib.config import parse_config
from steps.lib.store import open_store
from steps.mapping import build_vocab
from steps.train import draft_id
from steps.train import run as train
from tests.builders import byte_tokenizer, tiny_llama

LAYER_IDS = [1, 2, 3]
IDS = {"target": "7a70000000000003", "dataset": "da7a000000000003", "vocab": "70c0000000000003"}
pytestmark = pytest.mark.usefixtures("one_thread")


def make_inputs(root: Path) -> None:
    """A tiny Llama target with a tokenizer, 24 conversations of 10..40 tokens, a 96-token draft vocab."""
    store = open_store(f"file://{root}")
    w = store.begin("target", IDS["target"], step="target")
    tiny_llama(vocab_size=300, hidden_size=64, intermediate_size=128).save_pretrained(w.staging)
    byte_tokenizer().save_pretrained(w.staging)
    w.commit(meta={"source": "tiny"})
    g = torch.Generator().manual_seed(5)
    rows, counts = [], Counter()
    for k, n in enumerate(torch.randint(10, 40, (24,), generator=g).tolist()):
        ids = torch.randint(3, 259, (n,), generator=g).tolist()
        rows.append({"id": f"c{k}", "source": "hand", "messages": [], "input_ids": ids,
                     "loss_mask": [int(i >= n // 3) for i in range(n)]})
        counts.update(ids)
    w = store.begin("dataset", IDS["dataset"], step="datagen")
    w.path("conversations/part-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    w.commit(metrics={"ok": len(rows)})
    d2t, t2d = build_vocab(counts, 300, 96)
    w = store.begin("vocab", IDS["vocab"], step="mapping")
    save_file({"d2t": d2t, "t2d": t2d}, str(w.path("vocab.safetensors")))
    w.commit(meta={"target_vocab": 300})


def config(hidden_states: str, online_memory: int | str = 0):
    return parse_config({"name": "o", "target": {"source": "tiny"}, "mapping": {"draft_vocab_size": 96},
                         "extract": {"aux_layer_ids": LAYER_IDS, "shard_tokens": 200, "batch_size": 4},
                         "train": {"hidden_states": hidden_states, "ttt_steps": 3, "lr": 3e-3, "epochs": 2,
                                   "batch_tokens": 128, "max_length": 64, "checkpoint_every": 3,
                                   "eval_every": 0, "device": "cpu", "online_memory": online_memory}})


def log_of(root: Path, draft_id: str) -> list[dict]:
    return [json.loads(line) for line in (root / "artifacts/draft" / draft_id / "train_log.jsonl").open()]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("online") / "src"
    make_inputs(root)
    return root


@pytest.fixture(scope="module")
def offline(src, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("offline") / "store"
    shutil.copytree(src, root)
    store = open_store(f"file://{root}")
    hidden = extract(config("offline"), store, IDS["target"], IDS["dataset"])
    m = train(config("offline"), store, IDS["target"], hidden.id, IDS["vocab"])
    return {"root": root, "manifest": m, "log": log_of(root, m.id)}


def test_online_training_gives_the_offline_loss_curve_bit_for_bit_and_stores_no_hidden_states(src, offline,
                                                                                              tmp_path):
    root = tmp_path / "store"
    shutil.copytree(src, root)
    m = train(config("online"), open_store(f"file://{root}"), IDS["target"], IDS["dataset"], IDS["vocab"])
    log = log_of(root, m.id)
    assert len(log) == len(offline["log"]) >= 6
    # step 0 is one fixed batch: the same loss exactly; then every step of the run
    assert [r["loss"] for r in log] == [r["loss"] for r in offline["log"]]
    assert [r["shard"] for r in log] == [r["shard"] for r in offline["log"]]
    assert m.metrics["final_loss"] == offline["manifest"].metrics["final_loss"]
    a = load_file(str(root / "artifacts/draft" / m.id / "model.safetensors"))
    b = load_file(str(offline["root"] / "artifacts/draft" / offline["manifest"].id / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # lineage: the dataset and the target, no hidden artifact; nothing extracted onto the store
    assert m.inputs == {"target": IDS["target"], "dataset": IDS["dataset"], "vocab": IDS["vocab"]}
    assert not (root / "artifacts/hidden").exists()
    assert m.metrics["shards_total"] == offline["manifest"].metrics["shards_total"] >= 2


@pytest.mark.parametrize("memory", ["1GB", "40kB"])
def test_shards_kept_in_memory_skip_the_targets_forward_and_give_the_same_loss_curve(src, offline, tmp_path,
                                                                                     memory):
    root = tmp_path / "store"
    shutil.copytree(src, root)
    m = train(config("online", memory), open_store(f"file://{root}"), IDS["target"], IDS["dataset"], IDS["vocab"])
    assert m.id == draft_id(config("online"), m.inputs)            # how states are kept is not in the id
    assert [r["loss"] for r in log_of(root, m.id)] == [r["loss"] for r in offline["log"]]
    shards, loads = m.metrics["shards_total"], len(log_of(root, m.id))
    kept = m.metrics["cache_peak_bytes"]
    if memory == "1GB":            # every shard kept: the target ran once over each, not once per epoch
        assert m.metrics["shards_computed"] == shards and kept > 0
    else:                          # a budget for some shards: those computed once, the rest every epoch
        assert 0 < kept <= 40_000 and shards < m.metrics["shards_computed"] < 2 * shards <= loads


def test_online_without_kept_shards_runs_the_target_over_every_shard_of_every_epoch(src, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(src, root)
    m = train(config("online"), open_store(f"file://{root}"), IDS["target"], IDS["dataset"], IDS["vocab"])
    assert m.metrics["cache_peak_bytes"] == 0
    assert m.metrics["shards_computed"] >= 2 * m.metrics["shards_total"]       # two epochs, nothing kept


def test_a_killed_online_run_resumes_from_its_checkpoint_to_the_uninterrupted_weights(src, offline, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(src, root)
    store = open_store(f"file://{root}")

    def stop(step: int, rec: dict) -> None:
        if step == 4:                        # after checkpoint-3, before checkpoint-6
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(config("online"), store, IDS["target"], IDS["dataset"], IDS["vocab"], on_step=stop)
    steps: list[int] = []
    m = train(config("online"), store, IDS["target"], IDS["dataset"], IDS["vocab"],
              on_step=lambda step, rec: steps.append(step))
    assert steps[0] == 4                     # resumed after step 3, not from the start
    a = load_file(str(root / "artifacts/draft" / m.id / "model.safetensors"))
    b = load_file(str(offline["root"] / "artifacts/draft" / offline["manifest"].id / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_pipeline_skips_extract_online_and_calls_train_with_the_dataset(src, offline, tmp_path):
    from steps.registry import call_step, skipped
    assert skipped("extract", config("online")) and not skipped("extract", config("offline"))
    assert not any(skipped(s, config("online")) for s in ("datagen", "mapping", "train", "export"))
    root = tmp_path / "store"
    shutil.copytree(src, root)
    # what flows/pipeline.py calls with extract skipped: train's `hidden` input is the dataset
    rec = call_step("train", config("online"), open_store(f"file://{root}"),
                    {"target": IDS["target"], "hidden": IDS["dataset"], "vocab": IDS["vocab"]})
    assert rec["metrics"]["final_loss"] == offline["manifest"].metrics["final_loss"]
