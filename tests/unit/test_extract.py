"""Extraction: hooks capture the right layers, rounds stay under the disk budget (F8), a killed
run resumes without recomputing or losing a shard, fp8 storage, the SGLang client, bad budgets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from steps.extract import ShardFormat, extract_shard, hidden_id, main, plan_shards, run
from steps.lib import layer_ids as layers
from steps.lib.config import load_config
from steps.lib.data.shards import bytes_per_token, iter_sequences, read_shard
from steps.lib.extraction.capture import LocalBackend, SGLangBackend
from steps.lib.store import PARTIAL, open_store, sha256_file
from tests.conftest import S3_BUCKET

ROOT = Path(__file__).resolve().parents[2]
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
os.environ.update(OFFLINE)
H, N_LAYERS, LAYER_IDS = 64, 4, [1, 2, 3]
pytestmark = pytest.mark.usefixtures("one_thread")


# --- fixtures: a seeded tiny target and a hand-written dataset in a file store -----------------------

def _tiny_model_and_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=H, intermediate_size=128,
                                         num_hidden_layers=N_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512, pad_token_id=0)).eval()
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: i + 3 for i, c in enumerate(alphabet)}, merges=[]))
    tk.add_special_tokens(["<pad>", "<|im_start|>", "<|im_end|>"])
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(use_regex=False), decoders.ByteLevel()
    return model, PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<|im_end|>")


def _lengths(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(8, 70, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A file store holding a `target` (tiny Llama HF dir) and a `dataset` (60 conversations)."""
    root = tmp_path_factory.mktemp("extract")
    model, tok = _tiny_model_and_tokenizer()
    g = torch.Generator().manual_seed(1)
    rows = []
    for k, n in enumerate(_lengths(60, seed=2)):
        ids = torch.randint(3, 300, (n,), generator=g).tolist()
        rows.append({"id": f"c{k}", "source": "hand", "messages": [], "input_ids": ids,
                     "loss_mask": [int(i >= n // 3) for i in range(n)]})
    world = {"root": root, "model": model, "tokenizer": tok, "rows": rows,
             "target": "7a70000000000003", "dataset": "da7a000000000003"}
    world["store"] = _populate(open_store(f"file://{root}/store", cache_dir=root / "cache"), world)
    return world


def _populate(store, world):
    """Write the world's target and dataset artifacts into `store`."""
    w = store.begin("target", world["target"], step="target")
    world["model"].save_pretrained(w.staging)
    world["tokenizer"].save_pretrained(w.staging)
    w.commit(meta={"source": "tiny"})
    w = store.begin("dataset", world["dataset"], step="datagen")
    w.path("conversations/part-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in world["rows"]))
    w.commit(metrics={"ok": len(world["rows"]), "tokens": sum(len(r["input_ids"]) for r in world["rows"])})
    return store


def _cfg(*overrides: str):
    return load_config(ROOT / "configs/tiny.yaml", [f"extract.aux_layer_ids={LAYER_IDS}", *overrides])


def _total_bytes(world, shard_tokens: int, dtype: str = "bfloat16") -> int:
    lengths = [len(r["input_ids"]) for r in world["rows"]]
    plans = plan_shards(lengths, shard_tokens, ShardFormat(tuple(LAYER_IDS), H, dtype))
    return sum(p.bytes_bound for p in plans)


def _all_tokens(store, m):
    """(input_ids, loss_mask) of every sequence of every shard, in shard order, verified by sha256."""
    seqs = []
    for rec in m.meta["shards"]:
        shard = read_shard(store.fetch_file("hidden", m.id, rec["path"], m))
        assert shard["layer_ids"] == LAYER_IDS
        assert shard["aux_hidden"].shape == (rec["tokens"], 3 * H)
        seqs += [(s["input_ids"].tolist(), s["loss_mask"].tolist()) for s in iter_sequences(shard)]
    return seqs


# --- (d) hooks capture exactly HF hidden_states[i] and hidden_states[-1] -------------------------------

def test_local_hooks_equal_output_hidden_states(world):
    model = world["model"]
    batch = [r["input_ids"] for r in world["rows"][:5]]
    backend = LocalBackend(model, LAYER_IDS)
    got = backend.capture(batch)
    backend.close()
    width = max(map(len, batch))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in batch])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in batch])
    with torch.inference_mode():
        hs = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        alone = model(torch.tensor([batch[1]]), output_hidden_states=True).hidden_states
    for b, seq in enumerate(batch):
        aux, final = got[b]
        assert torch.equal(aux, torch.cat([hs[i][b, :len(seq)] for i in LAYER_IDS], -1))
        assert torch.equal(final, hs[-1][b, :len(seq)])
    # Right padding leaves the real tokens' states as an unpadded forward computes them.
    assert torch.allclose(got[1][0], torch.cat([alone[i][0] for i in LAYER_IDS], -1), atol=1e-5)


# --- (a) rounds under a budget of 1/5 of the total ------------------------------------------------------

def test_rounds_stay_under_a_fifth_of_the_total_and_cover_every_token_once(world):
    store = world["store"]
    budget = _total_bytes(world, 200) // 5
    m = run(_cfg("extract.shard_tokens=200", f"extract.disk_budget={budget}"), store, world["target"], world["dataset"])
    assert m.kind == "hidden" and store.exists("hidden", m.id)
    assert 0 < m.meta["peak_local_bytes"] <= budget and m.meta["rounds"] >= 5
    assert m.meta["layer_ids"] == LAYER_IDS and m.meta["hidden_size"] == H and m.meta["num_aux"] == 3
    assert m.meta["storage_dtype"] == "bfloat16" and m.meta["computed_shards"] == len(m.meta["shards"])
    assert {f["path"] for f in m.files} == {s["path"] for s in m.meta["shards"]}
    store.verify("hidden", m.id)
    assert _all_tokens(store, m) == [(r["input_ids"], r["loss_mask"]) for r in world["rows"]]
    assert m.meta["tokens"] == sum(len(r["input_ids"]) for r in world["rows"])
    assert m.meta["bytes"] == m.total_bytes
    assert not (store.cache_dir / "extract-scratch" / m.id).exists()  # local copies gone
    again = run(_cfg("extract.shard_tokens=200", f"extract.disk_budget={budget}"), store, world["target"],
                world["dataset"])
    assert again.created == m.created  # finished work is reused, not recomputed


def test_rounds_on_an_s3_store_stage_in_the_cache_and_stay_under_budget(world, tmp_path, s3_endpoint):
    store = open_store(f"s3://{S3_BUCKET}/{uuid.uuid4().hex}", cache_dir=tmp_path / "cache", endpoint_url=s3_endpoint)
    _populate(store, world)
    budget = _total_bytes(world, 300) // 5
    m = run(_cfg("extract.shard_tokens=300", f"extract.disk_budget={budget}"), store, world["target"],
            world["dataset"])
    assert 0 < m.meta["peak_local_bytes"] <= budget and m.meta["rounds"] >= 5
    assert store.backend.list(f"artifacts/hidden/{m.id}/shards/") == [
        f"artifacts/hidden/{m.id}/{s['path']}" for s in m.meta["shards"]]
    assert not list((tmp_path / "cache" / "extract-scratch").rglob("*.safetensors"))
    assert _all_tokens(store, m) == [(r["input_ids"], r["loss_mask"]) for r in world["rows"]]


# --- (b) SIGKILL mid-run, then resume -----------------------------------------------------------------

def test_killed_run_resumes_without_recomputing_or_losing_shards(world, tmp_path):
    store = world["store"]
    sets = ["extract.shard_tokens=60", "extract.batch_size=1",
            f"extract.disk_budget={_total_bytes(world, 60) // 12}"]
    cfg = _cfg(*sets)
    art = store.backend.root / "artifacts" / "hidden" / hidden_id(cfg, world["target"], world["dataset"])
    cmd = [sys.executable, "-m", "steps.extract", "--config", "configs/tiny.yaml", "--store", store.uri,
           "--target", world["target"], "--dataset", world["dataset"]]
    for s in [f"extract.aux_layer_ids={LAYER_IDS}", *sets]:
        cmd += ["--set", s]
    env = {**os.environ, **OFFLINE, "EAGLENEST_CACHE": str(store.cache_dir), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120  # start-up (torch, transformers) is slow on a busy 2-core machine
    stage = store.backend.root / "staging" / "hidden" / art.name     # the killed writer's attempt lives here
    while time.time() < deadline and proc.poll() is None and not list(stage.glob(f"*/{PARTIAL}/shards/*.json")):
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, f"extract ended before it could be killed: {err.decode()[-2000:]}"
    assert not (art / "manifest.json").exists()
    attempt = next(iter(stage.glob(f"*/{PARTIAL}"))).parent
    committed = {p.name[:-5]: p for p in (attempt / PARTIAL / "shards").glob("*.json")}
    landed = {name: (attempt / "shards" / name).stat() for name in committed}
    hashes = {name: sha256_file(attempt / "shards" / name) for name in committed}
    assert committed, "killed before the first shard was uploaded"

    m = run(cfg, store, world["target"], world["dataset"])  # the re-run, in process (saves a start-up)
    assert m.id == art.name
    assert m.meta["resumed_shards"] >= len(committed)
    assert m.meta["computed_shards"] == len(m.meta["shards"]) - m.meta["resumed_shards"]
    for name, st in landed.items():  # not rewritten: same inode, same mtime, same bytes
        now = (art / "shards" / name).stat()
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
        assert m.file(f"shards/{name}")["sha256"] == hashes[name]
    store.verify("hidden", m.id)
    assert _all_tokens(store, m) == [(r["input_ids"], r["loss_mask"]) for r in world["rows"]]


# --- (c) fp8 storage ---------------------------------------------------------------------------------

def test_fp8_storage_halves_the_bytes_and_stays_close(world):
    store = world["store"]
    bf16 = run(_cfg("extract.shard_tokens=400"), store, world["target"], world["dataset"])
    fp8 = run(_cfg("extract.shard_tokens=400", "extract.storage_dtype=float8_e4m3fn"), store, world["target"],
              world["dataset"])
    assert fp8.id != bf16.id and fp8.meta["storage_dtype"] == "float8_e4m3fn"
    assert fp8.meta["bytes_per_token"] == bytes_per_token(H, 3, "float8_e4m3fn")
    assert fp8.meta["bytes"] < 0.55 * bf16.meta["bytes"]
    path = bf16.meta["shards"][0]["path"]
    a = read_shard(store.fetch_file("hidden", bf16.id, path))
    b = read_shard(store.fetch_file("hidden", fp8.id, path))
    assert b["dtype"] == "float8_e4m3fn" and torch.equal(a["input_ids"], b["input_ids"])
    for key in ("aux_hidden", "final_hidden"):
        rel = (a[key] - b[key]).norm(dim=-1) / a[key].norm(dim=-1)
        assert rel.max() < 2**-4 + 2**-8   # fp8's bound plus bf16's rounding of the reference


# --- (f) a budget that cannot hold one shard ----------------------------------------------------------

def test_budget_below_one_shard_fails_up_front_and_writes_nothing(world, capsys):
    store = world["store"]
    cfg = _cfg("extract.shard_tokens=250", "extract.disk_budget=20000")
    with pytest.raises(ValueError, match=r"extract\.disk_budget=20000 .*needs up to \d+ bytes.*extract\.shard_tokens"):
        run(cfg, store, world["target"], world["dataset"])
    art = store.backend.root / "artifacts" / "hidden" / hidden_id(cfg, world["target"], world["dataset"])
    assert not store.exists("hidden", art.name) and not art.exists()
    rc = main(["--config", str(ROOT / "configs/tiny.yaml"), "--store", store.uri, "--target", world["target"],
               "--dataset", world["dataset"], "--set", f"extract.aux_layer_ids={LAYER_IDS}",
               "--set", "extract.shard_tokens=250", "--set", "extract.disk_budget=20000"])
    assert rc == 2 and "Raise extract.disk_budget to at least" in capsys.readouterr().err
    assert not art.exists()


# --- (e) the SGLang client against a stand-in server ---------------------------------------------------

class StandInSGLang:
    """An HTTP server on 127.0.0.1 honouring the SGLang 0.5.23 contract the client relies on.

    aux mode (`--enable-return-aux-hidden-states --return-aux-hidden-state-layer-ids ids`): SGLang
    ids name "output of layer k" and capture k+1, so it returns HF hidden_states[k+1], concatenated.
    final mode (`--enable-return-hidden-states`): the post-norm last hidden state. Each sequence is
    run alone, as a server would, through `output_hidden_states` (not the client's hooks).
    """

    def __init__(self, model, *, sglang_layer_ids: list[int] | None, chunked_prefill_size: int = -1):
        self.model, self.ids, self.chunk = model, sglang_layer_ids, chunked_prefill_size
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, obj):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                aux = outer.ids is not None
                self._reply({"enable_return_aux_hidden_states": aux, "enable_return_hidden_states": not aux,
                             "return_aux_hidden_state_layer_ids": outer.ids,
                             "schedule": {"chunked_prefill_size": outer.chunk}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert body["return_hidden_states"] is True and body["sampling_params"]["max_new_tokens"] == 1
                self._reply([outer.generate(seq) for seq in body["input_ids"]])

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def generate(self, seq: list[int]) -> dict:
        with torch.inference_mode():
            hs = self.model(torch.tensor([seq]), output_hidden_states=True).hidden_states
        rows = torch.cat([hs[k + 1][0] for k in self.ids], -1) if self.ids is not None else hs[-1][0]
        return {"text": "", "output_ids": [0], "meta_info": {"prompt_tokens": len(seq), "completion_tokens": 1,
                                                             "hidden_states": [rows.tolist()]}}


def test_sglang_backend_gives_the_same_shards_as_the_local_backend(world, tmp_path):
    model, rows = world["model"], world["rows"]
    aux = StandInSGLang(model, sglang_layer_ids=layers.to_engine(LAYER_IDS, "sglang"))
    final = StandInSGLang(model, sglang_layer_ids=None)
    try:
        client = SGLangBackend(aux.url, final.url, LAYER_IDS, hidden_size=H)
        client.check_server(N_LAYERS)
        local = LocalBackend(model, LAYER_IDS)
        fmt = ShardFormat(tuple(LAYER_IDS), H, "bfloat16")
        plan = plan_shards([len(r["input_ids"]) for r in rows], 300, fmt)[1]
        seqs = [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in rows]
        for name, backend in (("sglang", client), ("local", local)):
            extract_shard(backend, plan, seqs, tmp_path / f"{name}.safetensors", batch_size=4,
                          fmt=fmt)
        a, b = read_shard(tmp_path / "sglang.safetensors"), read_shard(tmp_path / "local.safetensors")
        for key in ("input_ids", "loss_mask", "cu_seqlens"):
            assert torch.equal(a[key], b[key])
        assert a["layer_ids"] == b["layer_ids"] == LAYER_IDS
        for key in ("aux_hidden", "final_hidden"):  # equal up to bf16 rounding of fp32 noise
            assert torch.allclose(a[key], b[key], rtol=2**-7, atol=1e-4)
        # A server capturing other layers (ids not shifted by −1: F4) is refused before any request.
        wrong = StandInSGLang(model, sglang_layer_ids=LAYER_IDS)
        with pytest.raises(ValueError, match="--return-aux-hidden-state-layer-ids 0 1 2"):
            SGLangBackend(wrong.url, final.url, LAYER_IDS, hidden_size=H).check_server(N_LAYERS)
        wrong.server.shutdown()
        # Chunked prefill on (SGLang's H200 default, 8192): middle chunks carry no rows; refused, the flag named.
        chunked = StandInSGLang(model, sglang_layer_ids=None, chunked_prefill_size=8192)
        with pytest.raises(ValueError, match=r"chunked_prefill_size=8192.*--chunked-prefill-size -1$"):
            SGLangBackend(aux.url, chunked.url, LAYER_IDS, hidden_size=H).check_server(N_LAYERS)
        chunked.server.shutdown()
        # The first batch's rate gives the job's ETA; an absurd one is refused, naming the faster backend.
        client.expect(10 ** 12)
        with pytest.raises(ValueError, match=r"on the first batch .* h; use extract.backend=sharded"):
            client.capture([rows[0]["input_ids"]])
        client.expect(1)
        assert len(client.capture([rows[0]["input_ids"]])) == 1
        local.close()
        # SGLang's aux response carries no final hidden state: a client without the second server is refused.
        with pytest.raises(ValueError, match="two servers"):
            SGLangBackend(aux.url, None, LAYER_IDS, hidden_size=H)
        # An "aux" server that returns H-wide rows (aux capture off, F1's silent failure) is refused.
        with pytest.raises(ValueError, match=r"expected \[\d+, 192\]"):
            SGLangBackend(final.url, final.url, LAYER_IDS, hidden_size=H).capture([rows[0]["input_ids"]])
    finally:
        aux.server.shutdown()
        final.server.shutdown()


def test_the_sglang_capture_server_is_told_ids_in_its_target_familys_convention():
    """`--return-aux-hidden-state-layer-ids` reaches the target class's set_eagle3_layers_to_capture (SGLang
    0.5.23 spec_aux_hidden_state.py): on a DeepSeek-V3 target, ids not starting at internal 2 go unshifted."""
    def ids(arch):
        return SGLangBackend("http://a", "http://b", [3, 4, 5], hidden_size=8, target_arch=arch).sglang_layer_ids
    assert ids("DeepseekV3ForCausalLM") == [3, 4, 5] and ids("LlamaForCausalLM") == ids(None) == [2, 3, 4]


# --- (f) the in-process SGLang runner backend, where SGLang is not installed ----------------------------

def test_the_sglang_runner_backend_without_sglang_fails_in_one_line_naming_the_fix(world, capsys):
    """The main venv has no SGLang: selecting the backend is refused before any work (the CPU parts run
    against SGLang's own classes in tests/integration/test_sglang_runner.py)."""
    rc = main(["--config", str(ROOT / "configs/tiny.yaml"), "--store", world["store"].uri, "--target", world["target"],
               "--dataset", world["dataset"], "--set", f"extract.aux_layer_ids={LAYER_IDS}",
               "--set", "extract.backend=sglang_runner"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "extract.backend=sglang_runner needs SGLang" in err[0] and "pip install sglang==0.5.23" in err[0]


def test_the_runner_memory_fraction_changes_no_byte_and_no_id():
    cfg = _cfg()
    assert hidden_id(cfg, "t", "d") == hidden_id(_cfg("extract.runner_mem_fraction=0.6"), "t", "d")


def test_the_sglang_runner_trusts_no_remote_code_unless_the_target_says_so():
    from steps.lib.extraction.sglang_runner import runner_server_args

    args = dict(arch="LlamaForCausalLM", tp_size=1)
    assert runner_server_args("/t", [1, 2, 3], **args)["trust_remote_code"] is False
    assert runner_server_args("/t", [1, 2, 3], trust_remote_code=True, **args)["trust_remote_code"] is True
