"""Several processes on the CPU (gloo): 2 ranks train the same steps as 1 process, a checkpoint saved
at world size 2 resumes at world size 1, and extraction over 2 ranks writes the 1-process shards.

The 2-rank runs are real: `torchrun` (python -m torch.distributed.run) running the steps' CLIs, and
torch.multiprocessing for the run that is interrupted at a chosen step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import yaml
from safetensors.torch import load_file, save_file

from steps.extract import run as extract
from steps.lib.config import parse_config
from steps.lib.data.shards import write_shard
from steps.lib.runtime import distributed
from steps.lib.store import open_store
from steps.mapping import build_vocab
from steps.train import run as train
from tests.builders import byte_tokenizer, free_port, tiny_llama

ROOT = Path(__file__).resolve().parents[2]
LAYER_IDS = [1, 2, 3]
#: 18 sequences of 32 tokens pack 2 per 64-token row: 9 rows, batches of 4, 4 and 1 row, so the
#: 1-row batch leaves rank 1 with nothing but padding (the path that must not hang DDP/FSDP).
SHARDS, SEQS_PER_SHARD, PROMPT, ANSWER = 2, 18, 6, 26
TRAIN = {"ttt_steps": 3, "lr": 3e-3, "epochs": 2, "batch_tokens": 256, "max_length": 64,
         "checkpoint_every": 3, "warmup_ratio": 0.05}
STOP_AT = 7                                       # after checkpoint-6, before checkpoint-9
TORCHRUN_TIMEOUT_S = 900                          # two processes importing torch on a shared 2-core machine
pytestmark = pytest.mark.usefixtures("one_thread")


# --- inputs: hand-written target / hidden / vocab artifacts ------------------------------------------------

def train_inputs(root: Path) -> dict[str, str]:
    """A tiny target, 2 hidden shards of its greedy continuations and a 96-token draft vocab."""
    store = open_store(f"file://{root}")
    model = tiny_llama(vocab_size=256, hidden_size=64, intermediate_size=128, tie_word_embeddings=True,
                       initializer_range=0.5)
    w = store.begin("target", "7a70000000000001", step="target")
    model.save_pretrained(w.staging)
    w.commit(meta={"source": "tiny", "name": "tiny-test"})
    w, shards, counts = store.begin("hidden", "41d0000000000001", step="extract"), [], Counter()
    for s in range(SHARDS):
        ids = torch.randint(0, 256, (SEQS_PER_SHARD, PROMPT), generator=torch.Generator().manual_seed(s))
        with torch.no_grad():
            for _ in range(ANSWER):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            hs = model(ids, output_hidden_states=True).hidden_states
        seqs = ids.tolist()
        rel = f"shards/shard-{s:05d}.safetensors"
        info = write_shard(w.path(rel), seqs, [[0] * PROMPT + [1] * ANSWER] * len(seqs),
                           torch.cat([hs[i] for i in LAYER_IDS], -1).flatten(0, 1), hs[-1].flatten(0, 1),
                           layer_ids=LAYER_IDS)
        shards.append({"path": rel, "tokens": info["tokens"], "sequences": info["sequences"]})
        counts.update(t for seq in seqs for t in seq[PROMPT:])
    w.commit(meta={"layer_ids": LAYER_IDS, "hidden_size": 64, "num_aux": 3, "shards": shards})
    d2t, t2d = build_vocab(counts, 256, 96)
    w = store.begin("vocab", "70c0000000000001", step="mapping")
    save_file({"d2t": d2t, "t2d": t2d}, str(w.path("vocab.safetensors")))
    w.commit(meta={"target_vocab": 256})
    return {"target_id": "7a70000000000001", "hidden_id": "41d0000000000001", "vocab_id": "70c0000000000001"}


def config_data(**train) -> dict:
    return {"name": "t", "target": {"source": "tiny"}, "train": {**TRAIN, **train},
            "extract": {"aux_layer_ids": LAYER_IDS}, "mapping": {"draft_vocab_size": 96}}


@pytest.fixture(scope="module")
def inputs(one_thread, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("inputs") / "store"
    return root, train_inputs(root)


@pytest.fixture(scope="module")
def one_process(inputs, tmp_path_factory) -> dict:
    """The reference: the whole run in this process (world size 1)."""
    src, ids = inputs
    root = tmp_path_factory.mktemp("one") / "store"
    shutil.copytree(src, root)
    m = train(parse_config(config_data()), open_store(f"file://{root}"), **ids)
    return {"manifest": m, "log": read_log(root, m.id), "weights": weights(root, m.id)}


def read_log(root: Path, draft_id: str) -> list[dict]:
    return [json.loads(line) for line in (root / "artifacts/draft" / draft_id / "train_log.jsonl").open()]


def weights(root: Path, draft_id: str) -> dict[str, torch.Tensor]:
    return load_file(str(root / "artifacts/draft" / draft_id / "model.safetensors"))


def torchrun(tmp_path: Path, module: str, args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", module, *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "EAGLENEST_CACHE": str(tmp_path / "cache")}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def assert_same_curve(log_a: list[dict], log_b: list[dict]) -> None:
    assert [r["step"] for r in log_a] == [r["step"] for r in log_b]
    for a, b in zip(log_a, log_b, strict=True):
        assert (a["tokens"], a["positions"], a["shard"]) == (b["tokens"], b["positions"], b["shard"])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3, abs=1e-6), a["step"]
        assert [x is None for x in a["acc"]] == [x is None for x in b["acc"]]
        assert [x for x in a["acc"] if x is not None] == pytest.approx([x for x in b["acc"] if x is not None],
                                                                       abs=1e-6)


# --- training ----------------------------------------------------------------------------------------------

def test_two_gloo_ranks_under_torchrun_follow_the_one_process_loss_curve(inputs, one_process, tmp_path):
    src, ids = inputs
    shutil.copytree(src, tmp_path / "store")
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config_data()))
    out = torchrun(tmp_path, "steps.train", ["--config", str(tmp_path / "cfg.yaml"), "--store",
                                             f"file://{tmp_path / 'store'}", "--target", ids["target_id"],
                                             "--hidden", ids["hidden_id"], "--vocab", ids["vocab_id"], "--json"])
    printed = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(printed) == 1                                            # rank 0 answers for the job
    ref = one_process["manifest"]
    assert printed[0]["id"] == ref.id                                   # the world size is not in the id
    assert printed[0]["metrics"]["world_size"] == 2 and printed[0]["metrics"]["parallel"] == "ddp"
    log = read_log(tmp_path / "store", ref.id)
    assert len(log) == ref.metrics["steps"] == 12
    assert_same_curve(log, one_process["log"])
    assert log[-1]["loss"] < log[0]["loss"]                             # it learns, at both sizes
    two = weights(tmp_path / "store", ref.id)
    assert set(two) == set(one_process["weights"])
    for k, v in one_process["weights"].items():
        torch.testing.assert_close(two[k], v, rtol=1e-3, atol=1e-5)


class Stop(Exception):
    pass


def _interrupted_worker(rank: int, world_size: int, port: int, root: str, data: dict, ids: dict) -> None:
    """One rank of a 2-process FSDP run that stops after step STOP_AT (a crash between checkpoints)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)

    def stop(step, rec):
        if step == STOP_AT:
            raise Stop

    try:
        train(parse_config(data), open_store(f"file://{root}"), **ids, on_step=stop)
    except Stop:
        pass
    finally:
        distributed.shutdown()


def test_an_fsdp_checkpoint_saved_at_world_size_2_resumes_at_world_size_1(inputs, one_process, tmp_path):
    src, ids = inputs
    root = tmp_path / "store"
    shutil.copytree(src, root)
    data = config_data(parallel="fsdp")
    mp.spawn(_interrupted_worker, args=(2, free_port(), str(root), data, ids), nprocs=2, join=True)
    ref = one_process["manifest"]
    [staging] = (root / "staging/draft" / ref.id).glob("a-*")        # parallel is not in the id either
    assert [p.name for p in staging.glob("checkpoint-*")] == ["checkpoint-00000006"]
    assert json.loads((staging / "checkpoint-00000006/state.json").read_text())["world_size"] == 2
    ckpt = load_file(str(staging / "checkpoint-00000006/model.safetensors"))
    assert ckpt["fc.weight"].shape == (64, 3 * 64)                      # gathered, not a shard
    assert_same_curve([json.loads(line) for line in (staging / "train_log.jsonl").read_text().splitlines()][:STOP_AT],
                      one_process["log"][:STOP_AT])                         # FSDP = 1 process too

    resumed = train(parse_config(data), open_store(f"file://{root}"), **ids)       # world size 1 now
    assert resumed.id == ref.id and resumed.metrics["world_size"] == 1
    log = read_log(root, ref.id)
    assert [r["step"] for r in log] == list(range(ref.metrics["steps"]))
    assert_same_curve(log, one_process["log"])
    for k, v in one_process["weights"].items():
        torch.testing.assert_close(weights(root, ref.id)[k], v, rtol=1e-3, atol=1e-5)


# --- extraction --------------------------------------------------------------------------------------------

def extract_inputs(root: Path) -> dict[str, str]:
    """A tiny Llama target with a tokenizer and a dataset of 40 conversations of 10..60 tokens."""
    store = open_store(f"file://{root}")
    tok = byte_tokenizer()
    w = store.begin("target", "7a70000000000002", step="target")
    tiny_llama(vocab_size=300, hidden_size=64, intermediate_size=128).save_pretrained(w.staging)
    tok.save_pretrained(w.staging)
    w.commit(meta={"source": "tiny"})
    g = torch.Generator().manual_seed(3)
    rows = []
    for k, n in enumerate(torch.randint(10, 60, (40,), generator=g).tolist()):
        rows.append({"id": f"c{k}", "source": "hand", "messages": [],
                     "input_ids": torch.randint(3, 259, (n,), generator=g).tolist(),
                     "loss_mask": [int(i >= n // 3) for i in range(n)]})
    w = store.begin("dataset", "da7a000000000002", step="datagen")
    w.path("conversations/part-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    w.commit(metrics={"ok": len(rows)})
    return {"target_id": "7a70000000000002", "dataset_id": "da7a000000000002"}


def extract_config() -> dict:
    # ~100-token shards bound at ~54 KB (bf16, (3 aux + 1 final) × 64 wide = 512 B a token): ~14 shards;
    # a 240 KB budget is 120 KB a rank at world size 2, so each rank runs several rounds of two shards.
    return {"name": "x", "target": {"source": "tiny"},
            "extract": {"aux_layer_ids": LAYER_IDS, "shard_tokens": 100, "disk_budget": 240_000, "batch_size": 4}}


def test_two_ranks_extract_disjoint_shard_ranges_whose_union_is_the_one_process_output(tmp_path):
    ids = extract_inputs(tmp_path / "src")
    shutil.copytree(tmp_path / "src", tmp_path / "one")
    shutil.copytree(tmp_path / "src", tmp_path / "two")
    one = extract(parse_config(extract_config()), open_store(f"file://{tmp_path / 'one'}", cache_dir=tmp_path / "c1"),
              ids["target_id"], ids["dataset_id"])
    (tmp_path / "x.yaml").write_text(yaml.safe_dump(extract_config()))
    torchrun(tmp_path, "steps.extract", ["--config", str(tmp_path / "x.yaml"), "--store",
                                         f"file://{tmp_path / 'two'}", "--target", ids["target_id"],
                                         "--dataset", ids["dataset_id"]])
    store_two = open_store(f"file://{tmp_path / 'two'}")
    two = store_two.manifest("hidden", one.id)
    assert [(f["path"], f["size"]) for f in two.files] == [(f["path"], f["size"]) for f in one.files]
    assert len(one.files) >= 8
    # Same tensors, bit for bit. (Not the same file sha256: safetensors writes its metadata map in a
    # per-process hash order, so the header bytes differ between any two processes.)
    for f in one.files:
        a = load_file(str(tmp_path / "one/artifacts/hidden" / one.id / f["path"]))
        b = load_file(str(store_two.fetch_file("hidden", one.id, f["path"])))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f["path"]
    ranks = two.meta["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and two.meta["world_size"] == 2
    first, second = ranks[0]["shards"], ranks[1]["shards"]
    assert first and second and set(first).isdisjoint(second)
    assert first + second == list(range(len(one.meta["shards"])))      # contiguous ranges, in order
    budget = one.meta["disk_budget_bytes"]
    assert all(0 < r["peak_local_bytes"] <= budget // 2 for r in ranks)
    assert two.meta["peak_local_bytes"] <= budget and two.meta["rounds"] >= 4
    assert one.meta["world_size"] == 1 and one.meta["ranks"][0]["shards"] == first + second


# --- splitting work ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,size", [(10, 3), (2, 4), (0, 2), (8, 8)])
def test_rank_ranges_are_contiguous_disjoint_and_cover_everything(n, size):
    worlds = [distributed.World(rank=r, local_rank=r, size=size, device=torch.device("cpu")) for r in range(size)]
    blocks = [distributed.split_range(n, w) for w in worlds]
    assert [i for b in blocks for i in b] == list(range(n))
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
    rows = list(range(n))
    assert sorted(x for w in worlds for x in distributed.split_strided(rows, w)) == rows
