"""Training-time-test training on a tiny seeded target: learning, resume, shards, the artifact."""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from steps.lib.artifacts import load_draft
from steps.lib.checks.vocab import validate_vocab
from steps.lib.config import parse_config
from steps.lib.data.shards import write_shard
from steps.lib.store import open_store
from steps.lib.training.loop import lr_at
from steps.lib.training.plan import build_plan, pack
from steps.lib.training.ttt import layouts, ttt_mask
from steps.mapping import build_vocab
from steps.train import read_target_head, run
from tests.builders import full_disk_in
from tests.conftest import S3_BUCKET

LAYER_IDS = [1, 2, 3]
SEQS_PER_SHARD, SHARDS, PROMPT, ANSWER = 16, 3, 6, 26
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_target(out: Path, *, tied: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=tied, rope_theta=10000.0,
                      initializer_range=0.5)   # peaked next-token distributions: something to learn
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out)
    return model


def greedy_sequences(model, n: int, seed: int) -> list[list[int]]:
    """Random prompts continued greedily by the target: the answers are its argmax, as datagen's are."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n, PROMPT), generator=g)
    with torch.no_grad():
        for _ in range(ANSWER):
            nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids.tolist()


def write_source_store(root: Path) -> dict[str, str]:
    """target, hidden (3 shards) and vocab artifacts written by hand in the documented formats."""
    store = open_store(f"file://{root}")
    w = store.begin("target", "tgt", step="target")
    model = tiny_target(w.staging)
    w.commit(meta={"source": "tiny", "name": "tiny-test"})
    w = store.begin("hidden", "hid", step="extract")
    shards, counts = [], Counter()
    for s in range(SHARDS):
        seqs = greedy_sequences(model, SEQS_PER_SHARD, seed=s)
        masks = [[0] * PROMPT + [1] * ANSWER for _ in seqs]
        with torch.no_grad():
            hs = model(torch.tensor(seqs), output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i] for i in LAYER_IDS], dim=-1).flatten(0, 1)
        rel = f"shards/shard-{s:05d}.safetensors"
        info = write_shard(w.path(rel), seqs, masks, aux, hs[-1].flatten(0, 1), layer_ids=LAYER_IDS)
        shards.append({"path": rel, "tokens": info["tokens"], "sequences": info["sequences"]})
        counts.update(t for seq in seqs for t in seq[PROMPT:])
    w.commit(meta={"layer_ids": LAYER_IDS, "hidden_size": 64, "num_aux": 3, "shards": shards})
    d2t, t2d = build_vocab(counts, 256, 96)
    w = store.begin("vocab", "voc", step="mapping")
    save_file({"d2t": d2t, "t2d": t2d}, str(w.path("vocab.safetensors")))
    w.commit(meta={"target_vocab": 256})
    return {"target_id": "tgt", "hidden_id": "hid", "vocab_id": "voc"}


@pytest.fixture(scope="module")
def source(one_thread, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("source") / "store"
    return root, write_source_store(root)


def fresh_store(source, tmp_path, name="store"):
    root, ids = source
    shutil.copytree(root, tmp_path / name)
    return open_store(f"file://{tmp_path / name}"), ids


def config(**train):
    # τ while training off: these tests count every token and step (tests/unit/test_train_eval.py has it on)
    base = {"ttt_steps": 3, "lr": 3e-3, "epochs": 8, "batch_tokens": 256, "max_length": 64,
            "checkpoint_every": 1000, "warmup_ratio": 0.05, "eval_every": 0}
    return parse_config({"name": "t", "target": {"source": "tiny"}, "train": {**base, **train},
                         "extract": {"aux_layer_ids": LAYER_IDS}, "mapping": {"draft_vocab_size": 96}})


def test_training_reduces_the_loss_and_raises_step0_accuracy(source, tmp_path):
    store, ids = fresh_store(source, tmp_path)
    m = run(config(lr=1e-2, epochs=16), store, **ids)
    log = [json.loads(line) for line in (tmp_path / "store/artifacts/draft" / m.id / "train_log.jsonl").open()]
    first = log[0]
    assert m.metrics["steps"] == len(log) == m.metrics["planned_steps"]
    # the floor is the target's own entropy (≈ half the start here), so -25% is most of the way
    assert m.metrics["final_loss"] < 0.75 * first["loss"], (first["loss"], m.metrics["final_loss"])
    assert m.metrics["acc"][0] > first["acc"][0] + 0.35, (first["acc"], m.metrics["acc"])
    assert m.metrics["acc"][2] > first["acc"][2] + 0.25                   # the chain steps learn too
    assert len(m.metrics["acc"]) == 3
    assert m.metrics["shards_read"] == m.metrics["shards_total"] == SHARDS
    assert m.metrics["tokens"] == 16 * SHARDS * SEQS_PER_SHARD * (PROMPT + ANSWER)
    assert m.metrics["tokens_per_s"] > 0


def test_the_draft_artifact_holds_canonical_fp32_weights_the_vocab_map_and_its_config(source, tmp_path):
    store, ids = fresh_store(source, tmp_path)
    m = run(config(epochs=1), store, **ids)
    files = {f["path"] for f in m.files}
    assert files == {"model.safetensors", "draft_config.json", "train_log.jsonl"}   # no checkpoints left
    weights = load_file(str(store.fetch_file("draft", m.id, "model.safetensors")))
    assert {"midlayer.self_attn.q_proj.weight", "fc.weight", "lm_head.weight", "d2t", "t2d"} <= set(weights)
    assert all(v.dtype == torch.float32 for k, v in weights.items() if k not in ("d2t", "t2d"))
    validate_vocab(weights["d2t"], weights["t2d"], 256)
    model, meta = load_draft(store, m.id)
    assert meta["layer_ids"] == LAYER_IDS and meta["draft_vocab_size"] == 96 and meta["num_aux"] == 3
    assert meta["target"] == {"num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 256,
                              "max_position_embeddings": 512, "name": "tiny-test"}
    assert torch.equal(model.lm_head.weight, weights["lm_head.weight"])
    assert run(config(epochs=1), store, **ids).id == m.id                  # finished: reused, not retrained


class Stop(Exception):
    pass


def stop_at(n: int):
    def on_step(step, rec):
        if step == n:
            raise Stop
    return on_step


def assert_same_weights(store_a, store_b, draft_id):
    a = load_file(str(store_a.fetch_file("draft", draft_id, "model.safetensors")))
    b = load_file(str(store_b.fetch_file("draft", draft_id, "model.safetensors")))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_an_interrupted_run_resumes_to_the_same_weights(source, tmp_path):
    cfg = config(epochs=2, checkpoint_every=3)
    store_a, ids = fresh_store(source, tmp_path, "a")
    full = run(cfg, store_a, **ids)
    store_b, _ = fresh_store(source, tmp_path, "b")
    with pytest.raises(Stop):
        run(cfg, store_b, **ids, on_step=stop_at(7))
    [staging] = (tmp_path / "b/staging/draft" / full.id).glob("a-*")     # the interrupted attempt
    assert [p.name for p in staging.glob("checkpoint-*")] == ["checkpoint-00000006"]
    resumed = run(cfg, store_b, **ids)
    assert resumed.id == full.id and resumed.metrics["steps"] == full.metrics["steps"]
    assert_same_weights(store_a, store_b, full.id)
    log = (tmp_path / "b/artifacts/draft" / full.id / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in log] == list(range(full.metrics["steps"]))
    assert not staging.exists()                                       # resumed in place, then moved into place


def test_an_unreadable_checkpoint_is_skipped_with_a_log_line_and_training_resumes_from_the_one_before(
        source, tmp_path, caplog):
    """A kill between a checkpoint's save and the old one's removal leaves two; the newest one damaged (an empty
    state.json, as a full disk left it before writes were atomic) is named and the one before is used."""
    cfg = config(epochs=2, checkpoint_every=3)
    store_a, ids = fresh_store(source, tmp_path, "a")
    full = run(cfg, store_a, **ids)
    store_b, _ = fresh_store(source, tmp_path, "b")
    with pytest.raises(Stop):
        run(cfg, store_b, **ids, on_step=stop_at(4))
    [staging] = (tmp_path / "b/staging/draft" / full.id).glob("a-*")
    shutil.copytree(staging / "checkpoint-00000003", tmp_path / "ckpt3")
    with pytest.raises(Stop):
        run(cfg, store_b, **ids, on_step=stop_at(7))
    shutil.copytree(tmp_path / "ckpt3", staging / "checkpoint-00000003")
    (staging / "checkpoint-00000006" / "state.json").write_text("")
    with caplog.at_level("WARNING"):
        resumed = run(cfg, store_b, **ids)
    assert [r.getMessage() for r in caplog.records if "checkpoint-00000006" in r.getMessage()], caplog.text
    assert resumed.metrics["steps"] == full.metrics["steps"]
    assert_same_weights(store_a, store_b, full.id)
    log = (tmp_path / "b/artifacts/draft" / full.id / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in log] == list(range(full.metrics["steps"]))


def test_truncated_checkpoint_weights_mean_a_fresh_start_not_a_crash(source, tmp_path, caplog):
    cfg = config(epochs=2, checkpoint_every=3)
    store_a, ids = fresh_store(source, tmp_path, "a")
    full = run(cfg, store_a, **ids)
    store_b, _ = fresh_store(source, tmp_path, "b")
    with pytest.raises(Stop):
        run(cfg, store_b, **ids, on_step=stop_at(7))
    [weights] = (tmp_path / "b/staging/draft" / full.id).glob("a-*/checkpoint-00000006/model.safetensors")
    weights.write_bytes(weights.read_bytes()[:100])
    with caplog.at_level("WARNING"):
        run(cfg, store_b, **ids)
    assert "skipped unreadable checkpoint" in caplog.text and str(weights.parent) in caplog.text
    assert_same_weights(store_a, store_b, full.id)


def test_a_torn_last_line_of_the_training_log_is_dropped_with_a_log_line(source, tmp_path, caplog):
    """A kill (or a full disk) mid-append leaves half a line; the re-run drops it, says so, and logs each step once."""
    cfg = config(epochs=2, checkpoint_every=3)
    store, ids = fresh_store(source, tmp_path)
    with pytest.raises(Stop):
        run(cfg, store, **ids, on_step=stop_at(7))
    [log_path] = (tmp_path / "store/staging/draft").glob("*/a-*/train_log.jsonl")
    with log_path.open("a") as f:
        f.write('{"step": 7, "lo')
    with caplog.at_level("WARNING"):
        m = run(cfg, store, **ids)
    assert "torn last line" in caplog.text and str(log_path) in caplog.text
    log = (tmp_path / "store/artifacts/draft" / m.id / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in log] == list(range(m.metrics["steps"]))


def test_a_full_disk_while_checkpointing_is_an_oserror_naming_the_file_not_a_torch_error(source, tmp_path,
                                                                                        monkeypatch):
    """torch.save to a path on a full disk raised RuntimeError("... unexpected pos ..."), naming nothing: the
    step boundary turns only an OSError into the one line naming the file and its free space."""
    from steps.lib.training import checkpoint
    from steps.registry import _one_line

    store, ids = fresh_store(source, tmp_path)
    full_disk_in(monkeypatch, checkpoint)                        # the optimizer state, written by torch.save
    with pytest.raises(OSError) as err:
        run(config(epochs=2, checkpoint_every=3), store, **ids)
    assert err.value.errno == errno.ENOSPC and err.value.filename.endswith("checkpoint-00000003/optimizer.pt")
    line = _one_line(err.value)
    assert line.startswith(f"no space left on device writing {err.value.filename} (filesystem ") and "free" in line


def test_every_shard_is_read_through_a_cache_smaller_than_the_data(source, tmp_path, s3_endpoint):
    """An S3 store (moto's server on 127.0.0.1): shards are downloaded into a cache holding about one shard."""
    root, ids = source
    store = open_store(f"s3://{S3_BUCKET}/{uuid.uuid4().hex}", cache_dir=tmp_path / "cache", endpoint_url=s3_endpoint)
    for p in root.rglob("*"):
        if p.is_file():
            store.backend.put_file(str(p.relative_to(root)), p)
    shard_bytes = max(f["size"] for f in store.manifest("hidden", ids["hidden_id"]).files)
    budget = int(1.5 * shard_bytes)
    m = run(config(epochs=2, cache_budget=budget), store, **ids)
    assert m.metrics["shards_read"] == m.metrics["shards_total"] == SHARDS
    assert 0 < m.metrics["cache_peak_bytes"] <= budget < SHARDS * shard_bytes
    left = list((tmp_path / "cache/hidden").rglob("*.safetensors"))
    assert len(left) == 1                                                  # the others were evicted


def test_packing_fills_rows_without_splitting_sequences_and_the_plan_is_seeded():
    lengths = [30, 10, 64, 20, 50, 5, 90]
    rows = pack(lengths, list(range(len(lengths))), 64)
    assert all(sum(n for _, n in row) <= 64 for row in rows)
    assert sorted(i for row in rows for i, _ in row) == list(range(7))
    assert dict(i_n for row in rows for i_n in row)[6] == 64                     # truncated to max_length
    plan = build_plan({"a": lengths, "b": lengths[:3]}, epochs=2, seed=1, max_length=64, rows_per_batch=2)
    assert plan == build_plan({"a": lengths, "b": lengths[:3]}, epochs=2, seed=1, max_length=64, rows_per_batch=2)
    assert plan != build_plan({"a": lengths, "b": lengths[:3]}, epochs=2, seed=2, max_length=64, rows_per_batch=2)
    half = build_plan({"a": lengths, "b": lengths[:3]}, epochs=0.5, seed=1, max_length=64, rows_per_batch=2)
    assert 0 < len(half) < len(plan) // 2 + 1


def test_ttt_masks_are_block_diagonal_for_real_keys_and_diagonal_for_chain_keys():
    doc = torch.tensor([[0, 0, 0, 1, 1, -1]])
    lays = layouts(None, doc, 3)
    m = [ttt_mask(doc, lays, j) for j in range(3)]
    assert [tuple(x.shape) for x in m] == [(1, 1, 6, 6), (1, 1, 6, 12), (1, 1, 6, 18)]
    real = m[2][0, 0, :, :6]
    assert real[4].tolist() == [False, False, False, True, True, False]     # own sequence, <= p
    assert real[2].tolist() == [True, True, True, False, False, False]
    assert torch.equal(m[0][0, 0, 5], torch.tensor([False] * 5 + [True]))   # padding sees only itself
    assert torch.equal(m[2][0, 0, :, 6:12], torch.eye(6, dtype=torch.bool))
    assert torch.equal(m[2][0, 0, :, 12:], torch.eye(6, dtype=torch.bool))


def test_chain_steps_compute_only_positions_with_a_counted_prediction_left():
    doc = torch.tensor([[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0]])
    valid = [torch.tensor([[0, 1, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0]]).bool(),
             torch.tensor([[1, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0]]).bool()]
    lays = layouts(valid, doc, 2)
    assert lays[0].idx.tolist() == [list(range(6))] * 2                    # step 0: every real key
    assert lays[1].idx[:, :1].tolist() == [[0], [2]] and lays[1].idx.shape == (2, 1)
    mask = ttt_mask(doc, lays, 1)[:, 0]                                    # [B, 1, 6 + 1]
    assert mask[0, 0].tolist() == [True, False, False, False, False, False, True]
    assert mask[1, 0].tolist() == [True, True, True, False, False, False, True]


def test_lr_warms_up_then_decays_to_min_ratio():
    kw = dict(lr=1.0, warmup_ratio=0.1, min_lr_ratio=0.1)
    assert lr_at(0, 100, **kw) == pytest.approx(0.1)
    assert lr_at(9, 100, **kw) == pytest.approx(1.0)
    assert lr_at(99, 100, **kw) == pytest.approx(0.1, abs=1e-3)
    assert lr_at(50, 100, **kw) < lr_at(20, 100, **kw)


def test_a_frozen_head_stays_the_targets_rows_while_the_layer_learns(source, tmp_path):
    """train.freeze_lm_head (speculators' recipe): the exported head is exactly the target's rows of the
    draft vocab, the layer and fc still train; without init_lm_head the config is refused."""
    from steps.lib.artifacts import target_dir

    store, ids = fresh_store(source, tmp_path)
    m = run(config(epochs=2, freeze_lm_head=True), store, **ids)
    weights = load_file(str(store.fetch_file("draft", m.id, "model.safetensors")))
    tdir = target_dir(store, ids["target_id"])
    head = read_target_head(tdir, json.loads((tdir / "config.json").read_text()))["lm_head.weight"]
    d2t = weights["d2t"]
    assert torch.equal(weights["lm_head.weight"], head[d2t + torch.arange(len(d2t))].float())
    trained = run(config(epochs=2), store, **ids)                     # the same run with the head trained
    other = load_file(str(store.fetch_file("draft", trained.id, "model.safetensors")))
    assert not torch.equal(other["lm_head.weight"], weights["lm_head.weight"])
    assert not torch.equal(other["fc.weight"], weights["fc.weight"])     # both trained fc, differently
    with pytest.raises(ValueError, match="init_lm_head"):
        config(freeze_lm_head=True, init_lm_head=False)


def test_target_head_handles_tied_and_untied_embeddings(tmp_path):
    tiny_target(tmp_path / "tied", tied=True)
    untied = tiny_target(tmp_path / "untied", tied=False)
    cfg = json.loads((tmp_path / "tied/config.json").read_text())
    head = read_target_head(tmp_path / "tied", cfg)
    assert torch.equal(head["lm_head.weight"], head["embed_tokens.weight"])
    cfg = json.loads((tmp_path / "untied/config.json").read_text())
    head = read_target_head(tmp_path / "untied", cfg)
    assert torch.equal(head["lm_head.weight"], untied.lm_head.weight)
    assert not torch.equal(head["lm_head.weight"], head["embed_tokens.weight"])
    os.remove(tmp_path / "untied/model.safetensors")
    save_file({"model.embed_tokens.weight": untied.model.embed_tokens.weight.detach()},
              str(tmp_path / "untied/model.safetensors"))
    with pytest.raises(KeyError, match="lm_head.weight"):
        read_target_head(tmp_path / "untied", cfg)


def test_the_manifest_accounts_for_the_train_steps_wall_time_by_phase(source, tmp_path):
    store, ids = fresh_store(source, tmp_path)
    m = run(config(epochs=1), store, **ids)
    phases = m.metrics["phases_s"]
    assert set(phases) == {"load", "lease", "train_steps", "data", "tau_sim", "checkpoints", "loop_other", "save"}
    assert all(v >= 0 for v in phases.values()) and phases["train_steps"] == m.metrics["train_s"]
    # each timed part is the loop's own timer (the shards were read; this config evaluates no τ_sim)
    assert phases["data"] == m.metrics["read_s"] > 0 and phases["tau_sim"] == m.metrics["eval_s"]
    assert sum(phases.values()) == pytest.approx(m.metrics["wall_s"], rel=1e-6)


def test_train_hidden_states_offline_is_id_neutral_and_online_is_a_different_draft():
    from steps.lib.config import load_config
    from steps.train import draft_id
    inputs = {"target": "a", "hidden": "b", "vocab": "c"}
    offline = load_config("configs/tiny.yaml")
    # the id main computed for configs/tiny.yaml before the field existed
    assert draft_id(offline, inputs) == "5992b912c66a2b6a"
    online = load_config("configs/tiny.yaml", ["train.hidden_states=online"])
    assert draft_id(online, inputs) != draft_id(offline, inputs)
