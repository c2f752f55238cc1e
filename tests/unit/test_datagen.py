"""Datagen: loss masks, end-to-end regeneration with the tiny target, resume, and the OpenAI backend."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from steps import datagen as D  # noqa: E402
from steps.lib import artifacts
from steps.lib.config import InputError, load_config  # noqa: E402
from steps.lib.data.prompts import training_prompts  # noqa: E402
from steps.lib.errors import ConfigError  # noqa: E402
from steps.lib.store import artifact_id, open_store, sha256_file  # noqa: E402
from tests.conftest import TINY_PRETRAIN  # noqa: E402

PROMPTS = ["What does `json.dumps` do? Explain briefly.", "Name three colors.", "Who are you?",
           "What is the `random.Random` class used for? Explain briefly.", "Write a haiku about tea.",
           "What does `os.path.join` do? Explain briefly.", "Say hello.", "What is 2+2?"]
CHUNK = 3


@pytest.fixture(scope="module")
def tiny(tiny_target):
    """The session's tiny target (tests/conftest.py) and its store: (store, target id, model, tokenizer)."""
    store, m, _ = tiny_target
    model, tok = artifacts.load_target(store, m.id)
    return store, m.id, model, tok


def prompt_file(path, prompts=PROMPTS):
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    return path


def cfg_for(path, *extra):
    return load_config("configs/tiny.yaml", [TINY_PRETRAIN,
                                             f"dataset.sources=[{{kind: file, path: '{path}'}}]",
                                             "datagen.max_new_tokens=12", "datagen.batch_size=4", *extra])


def masked_runs(tok, ids, mask):
    """Decoded text of each maximal run of loss_mask == 1."""
    runs, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur)), cur.clear()
    return runs + ([tok.decode(cur)] if cur else [])


# --- tokenize_conversation -------------------------------------------------------------------------------

def test_loss_mask_covers_exactly_assistant_text_and_end_of_turn(tiny):
    _, _, _, tok = tiny
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Count."},
            {"role": "assistant", "content": "1 2 3\nfour"}]
    ids, mask = D.tokenize_conversation(tok, msgs)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assert masked_runs(tok, ids, mask) == ["Hello! How can I help?<|im_end|>", "1 2 3\nfour<|im_end|>"]
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False)
    assert mask[-1] == 0  # the "\n" after <|im_end|> is template, not the assistant's


def test_templates_that_break_the_prefix_rule_are_refused(tiny):
    _, _, _, tok = tiny
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  padded  "}]
    trimming = tok.chat_template.replace("{{ m['content'] }}", "{{ m['content'] | trim }}")
    with pytest.raises(ValueError, match="chat template.*trims or rewrites"):
        D.tokenize_conversation(_with_template(tok, trimming), msgs)
    no_eot = tok.chat_template.replace("{{ m['content'] }}<|im_end|>", "{{ m['content'] }}\n\n")
    with pytest.raises(ValueError, match="chat template.*not by a special end-of-turn token"):
        D.tokenize_conversation(_with_template(tok, no_eot), msgs)


def _with_template(tok, template):
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = template
    return t


# --- local backend, end to end ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def clean_run(tiny, tmp_path_factory):
    store, tid, _, _ = tiny
    path = prompt_file(tmp_path_factory.mktemp("data") / "prompts.jsonl")
    m = D.run(cfg_for(path), store, tid, chunk_prompts=CHUNK)
    return store, tid, path, m


def test_datagen_local_writes_masked_conversations(tiny, clean_run):
    _, _, _, tok = tiny
    store, _, _, m = clean_run
    print("tiny datagen metrics:", m.metrics)
    assert m.metrics["ok"] + m.metrics["empty"] == len(PROMPTS) and m.metrics["ok"] >= 6
    assert m.metrics["errors"] == 0 and m.metrics["skipped"] == 0 and m.metrics["tokens_per_s"] > 0
    assert [f["path"] for f in m.files] == [f"conversations/part-{i:05d}.jsonl" for i in range(3)]
    rows = list(artifacts.read_conversations(store, m.id))
    assert len(rows) == m.metrics["ok"]
    assert sum(sum(r["loss_mask"]) for r in rows) == m.metrics["assistant_tokens"]
    assert sum(len(r["input_ids"]) for r in rows) == m.metrics["tokens"]
    for r in rows:
        assert r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"]
        assert masked_runs(tok, r["input_ids"], r["loss_mask"]) == [r["messages"][-1]["content"] + "<|im_end|>"]
        assert r["messages"][0] == {"role": "user", "content": PROMPTS[int(r["id"][1:])]}
    # the CPU default (`datagen.decoder: auto`) is the float32 loop, and the manifest says so
    assert (m.meta["decoder"], m.meta["dtype"]) == ("loop", "float32")


def test_the_engine_decoder_gives_the_loops_dataset_on_the_cpu(tiny, clean_run, monkeypatch):
    """`datagen.decoder=engine` at float32 (the CPU's dtype): the same greedy answers as the loop's dataset,
    under its own id, the decoder named in the manifest (and the engine, counted, made them)."""
    store, tid, path, loop = clean_run
    calls = []
    real = D.decode_engine
    monkeypatch.setattr(D, "decode_engine", lambda *a, **k: calls.append(k["slots"]) or real(*a, **k))
    m = D.run(cfg_for(path, "datagen.decoder=engine"), store, tid, chunk_prompts=CHUNK)
    assert calls and set(calls) == {4}                    # datagen.batch_size slots (`cfg_for`)
    assert m.id != loop.id and (m.meta["decoder"], m.meta["dtype"]) == ("engine", "float32")
    rows = [r["messages"] for r in artifacts.read_conversations(store, m.id)]
    assert rows == [r["messages"] for r in artifacts.read_conversations(store, loop.id)]


def test_auto_decoder_is_the_bf16_engine_on_a_gpu_only():
    assert D.resolve_decoder("auto", "cpu", "llama") == "loop"
    assert D.resolve_decoder("auto", "cuda", "llama") == "engine"
    assert D.resolve_decoder("auto", "cuda", "deepseek_v3") == "loop"     # a layout the engine does not run
    assert D.resolve_decoder("engine", "cpu", None) == "engine" and D.resolve_decoder("loop", "cuda", "llama") == "loop"
    assert D.engine_dtype("cpu") == torch.float32 and D.engine_dtype("cuda") == torch.bfloat16
    assert D.answer_dtype("engine", "cuda") == torch.bfloat16
    assert D.answer_dtype("loop", "cuda") == D.answer_dtype("engine", "cpu") == torch.float32


def test_a_gpus_bf16_answers_never_reuse_a_cpus_dataset(tiny, clean_run):
    """One store, one config, a CPU worker then a GPU worker: the GPU's datagen must not take the CPU's float32
    texts as its bf16 ones. The id `run` reuses by is planned from where it runs (`decoding`); on the CPU it is
    the committed dataset's, on a GPU another (the target read from the store: the tiny target is a llama)."""
    store, tid, path, m = clean_run
    cfg = cfg_for(path)
    prompts = D.with_samples(training_prompts(cfg.dataset, cfg.seed, cfg.datagen.max_prompt_tokens)[0], cfg.datagen)

    def planned_id(device):
        _, dtype = D.decoding(cfg, store, tid, device)
        return artifact_id("dataset", D.dataset_identity(cfg, prompts, CHUNK, dtype=dtype), {"target": tid})

    assert D.decoding(cfg, store, tid, "cuda") == ("engine", torch.bfloat16)
    assert D.decoding(cfg, store, tid, "cpu") == ("loop", torch.float32)
    assert planned_id("cpu") == m.id and planned_id("cuda") != m.id
    # a server writes what it writes, wherever datagen runs: no dtype of ours in its id
    served = cfg_for(path, "datagen.backend=openai", "datagen.server_url=http://127.0.0.1:9")
    assert D.decoding(served, store, tid, "cuda") == (None, None)


def test_datagen_is_greedy_deterministic_and_reused(tiny, clean_run):
    _, _, model, tok = tiny
    store, tid, path, m = clean_run
    assert D.run(cfg_for(path), store, tid, chunk_prompts=CHUNK).created == m.created
    row = next(artifacts.read_conversations(store, m.id))
    enc = tok.apply_chat_template(row["messages"][:-1], add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    alone = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    assert row["messages"][-1]["content"] == alone  # batched + padded == one at a time


def test_extra_samples_are_seeded_samples_beside_the_greedy_answer(tiny, clean_run):
    """`samples_per_prompt: 3`: the greedy answer (the same as a plain run's) plus two seeded samples per
    prompt, ids `<id>~<k>`; a different dataset id; the same answers when run again."""
    store, tid, path, greedy = clean_run
    cfg = cfg_for(path, "datagen.samples_per_prompt=3", "datagen.sample_temperature=1.5")
    m = D.run(cfg, store, tid, chunk_prompts=CHUNK)
    assert m.id != greedy.id and m.metrics["prompts"] == 3 * len(PROMPTS)
    # the samples depend on the generator's device: the manifest says which one drew them
    assert m.meta["device"] == artifacts.inference_device() == "cpu"
    rows = {r["id"]: r for r in artifacts.read_conversations(store, m.id)}
    plain = {r["id"]: r for r in artifacts.read_conversations(store, greedy.id)}
    assert {i for i in rows if "~" not in i} == set(plain)
    assert all(rows[i]["messages"] == plain[i]["messages"] for i in plain)      # the first answer is greedy
    extra = {i for i in rows if "~" in i}
    assert extra and {i.split("~")[1] for i in extra} <= {"1", "2"}
    assert all(rows[i]["messages"][:-1] == plain[i.split("~")[0]]["messages"][:-1] for i in extra
               if i.split("~")[0] in plain)
    # sampled at a high temperature, the tiny target's answers differ from its greedy ones
    differ = sum(rows[i]["messages"][-1] != plain[i.split("~")[0]]["messages"][-1] for i in extra
                 if i.split("~")[0] in plain)
    assert differ >= len(extra) // 2
    # seeded: a fresh computation (new store) gives the same samples
    again = open_store(f"file://{path.parent / 'again'}")
    import shutil
    shutil.copytree(artifacts.target_dir(store, tid), again.backend.local_path(again.key("target", tid)))
    m2 = D.run(cfg, again, tid, chunk_prompts=CHUNK)
    assert m2.id == m.id and [r["messages"] for r in artifacts.read_conversations(again, m2.id)] == \
        [r["messages"] for r in artifacts.read_conversations(store, m.id)]


def test_resume_skips_committed_chunks(tiny, clean_run, tmp_path, monkeypatch):
    _, tid, path, clean = clean_run
    store = open_store(f"file://{tmp_path / 'store'}")
    src = artifacts.target_dir(tiny[0], tid)  # same target artifact in a fresh store
    dst = store.backend.local_path(store.key("target", tid))
    import shutil
    shutil.copytree(src, dst)
    real, calls = D.answer_chunk, []

    def crash_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated crash")
        return real(*args, **kwargs)

    monkeypatch.setattr(D, "answer_chunk", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        D.run(cfg_for(path), store, tid, chunk_prompts=CHUNK)
    assert not store.exists("dataset", clean.id)
    assert len(store.partial_files("dataset", clean.id)) == 2
    calls.clear()
    monkeypatch.setattr(D, "answer_chunk", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    m = D.run(cfg_for(path), store, tid, chunk_prompts=CHUNK)
    assert len(calls) == 1 and m.id == clean.id
    assert {k: v for k, v in m.metrics.items() if k not in ("gen_s", "tokens_per_s")} == \
        {k: v for k, v in clean.metrics.items() if k not in ("gen_s", "tokens_per_s")}
    assert list(artifacts.read_conversations(store, m.id)) == list(artifacts.read_conversations(clean_run[0], clean.id))


def test_a_dataset_far_below_what_the_config_needs_is_said_before_answering_and_recorded(tiny, tmp_path, caplog):
    """Two prompts for configs/tiny.yaml (gate.min_tau 1.2: ~327 answers by benchmarks/README.md's curve)."""
    store, tid, _, _ = tiny
    path = prompt_file(tmp_path / "p.jsonl", PROMPTS[:2])
    with caplog.at_level("WARNING", logger="eaglenest.datagen"):
        m = D.run(cfg_for(path), store, tid)
    said = [r.getMessage() for r in caplog.records if "far below" in r.getMessage()]
    assert said and said[0].startswith("datagen: 2 answers, far below the ~327"), caplog.text
    assert m.metrics["answers_needed"] == 327 and "far below" in m.meta["size_warning"]


def test_long_prompts_are_skipped_counted_and_named_in_a_log_line(tiny, tmp_path, caplog):
    store, tid, _, _ = tiny
    path = prompt_file(tmp_path / "p.jsonl", ["Say hi.", "word " * 400])
    with caplog.at_level("WARNING", logger="eaglenest.datagen"):
        m = D.run(cfg_for(path, "datagen.max_prompt_tokens=64"), store, tid)
    assert m.metrics["skipped"] == 1 and m.metrics["ok"] + m.metrics["empty"] == 1
    assert "skipped 1 prompts longer than datagen.max_prompt_tokens=64: p1 (" in caplog.text


def test_a_row_over_the_byte_bound_of_max_prompt_tokens_is_refused_before_tokenizing(tiny, tmp_path):
    store, tid, _, _ = tiny
    path = prompt_file(tmp_path / "p.jsonl", ["Say hi.", "word " * 60_000])        # 300 KB > 4096 × 64
    with pytest.raises(InputError, match=rf"{path}:2: a line longer than the bound .*max_prompt_tokens=64"):
        D.run(cfg_for(path, "datagen.max_prompt_tokens=64"), store, tid)


def test_bad_input_leaves_no_artifact(tiny, tmp_path):
    store, tid, _, _ = tiny
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": ""}\n')
    before = store.list("dataset")
    with pytest.raises(ValueError, match=rf"{path}:2: field 'prompt'"):
        D.run(cfg_for(path), store, tid)
    assert store.list("dataset") == before


# --- openai backend against a real local HTTP server ------------------------------------------------------

class StandIn:
    """An OpenAI-compatible chat server on 127.0.0.1 that answers with the tiny target (greedy)."""

    def __init__(self, model, tok, fail_all=False, fail_first=0):
        self.model, self.tok, self.fail_all = model, tok, fail_all
        self.lock, self.answers = threading.Lock(), {}
        self.fail_first, self.requests, self.asked = fail_first, 0, []   # 503 to the first `fail_first`
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [{"id": "tiny-standin", "object": "model"}]})
                self._send(404, {"error": "not found"})

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/chat/completions" or req.get("model") != "tiny-standin":
                    return self._send(404, {"error": {"message": f"model {req.get('model')!r} not served"}})
                with outer.lock:
                    outer.requests += 1
                    overloaded = outer.requests <= outer.fail_first
                    outer.asked.append(req["messages"][-1]["content"])
                if overloaded:
                    return self._send(503, {"error": {"message": "overloaded, try again"}})
                if outer.fail_all or "FAIL" in req["messages"][-1]["content"]:
                    return self._send(500, {"error": {"message": "internal error"}})
                text, n, stop = outer.answer(req["messages"], req["max_tokens"], req["temperature"])
                self._send(200, {"id": "x", "object": "chat.completion", "model": "tiny-standin",
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                              "finish_reason": "stop" if stop else "length"}],
                                 "usage": {"prompt_tokens": 0, "completion_tokens": n, "total_tokens": n}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, messages, max_tokens, temperature):
        assert temperature == 0
        enc = self.tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
        with self.lock, torch.no_grad():
            out = self.model.generate(**enc, max_new_tokens=max_tokens, do_sample=False,
                                      pad_token_id=self.tok.pad_token_id, eos_token_id=self.tok.eos_token_id)
        gen = out[0, enc["input_ids"].shape[1]:].tolist()
        stop = self.tok.eos_token_id in gen
        gen = gen[:gen.index(self.tok.eos_token_id)] if stop else gen
        text = self.tok.decode(gen, skip_special_tokens=True)
        self.answers[messages[-1]["content"]] = text.strip()
        return text, len(gen) + stop, stop

    def close(self):
        self.server.shutdown()
        self.server.server_close()


FAST_RETRY = "datagen.retry_backoff_s=0.01"


def test_openai_requests_are_retried_through_a_burst_of_503s(tiny, tmp_path):
    store, tid, model, tok = tiny
    server = StandIn(model, tok, fail_first=6)
    try:
        path = prompt_file(tmp_path / "p.jsonl", PROMPTS[:5])
        m = D.run(cfg_for(path, "datagen.backend=openai", f"datagen.server_url={server.url}",
                          "datagen.concurrency=3", FAST_RETRY), store, tid)
    finally:
        server.close()
    assert m.metrics["errors"] == 0 and m.metrics["ok"] + m.metrics["empty"] == 5
    assert server.requests == 6 + 5       # each 503 cost one more request, nothing more
    for r in artifacts.read_conversations(store, m.id):
        assert r["messages"][-1]["content"] == server.answers[r["messages"][0]["content"]]
        assert masked_runs(tok, r["input_ids"], r["loss_mask"]) == [r["messages"][-1]["content"] + "<|im_end|>"]


def test_prompts_that_still_fail_fail_the_step_and_the_next_run_asks_only_for_them(tiny, tmp_path, capsys):
    store, tid, model, tok = tiny
    path = prompt_file(tmp_path / "p.jsonl", PROMPTS[:6])
    sets = [TINY_PRETRAIN, f"dataset.sources=[{{kind: file, path: '{path}'}}]",
            "datagen.max_new_tokens=12", "datagen.batch_size=4", "datagen.backend=openai", "datagen.retries=1",
            FAST_RETRY, "datagen.concurrency=1"]
    before = store.list("dataset")
    server = StandIn(model, tok, fail_first=4)      # 2 prompts × (1 try + 1 retry): both get no answer
    try:
        argv = ["--config", "configs/tiny.yaml", "--store", store.uri, "--set", f"datagen.server_url={server.url}"]
        assert D.main(argv + [a for s in sets for a in ("--set", s)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "2 of 6 prompts got no answer after 1 retries" in err
        assert "HTTPError" in err and "503" in err and "re-run datagen" in err
        assert store.list("dataset") == before       # nothing committed
        first_run = list(server.asked)
        assert len(first_run) == 4 + 4               # 2 failed twice, the 4 others answered once
        server.asked.clear()
        assert D.main(argv + [a for s in sets for a in ("--set", s)] + ["--json"]) == 0
        new_id = json.loads(capsys.readouterr().out)["id"]
    finally:
        server.close()
    # the second run asked only for the two prompts that had no answer
    assert len(server.asked) == 2 and set(server.asked) == {q for q in first_run if first_run.count(q) == 2}
    m = store.manifest("dataset", new_id)
    assert m.metrics["errors"] == 0 and m.metrics["ok"] + m.metrics["empty"] == 6
    rows = list(artifacts.read_conversations(store, new_id))
    assert len(rows) == m.metrics["ok"]
    for r in rows:
        assert r["messages"][-1]["content"] == server.answers[r["messages"][0]["content"]]


def test_openai_backend_fails_without_manifest_when_nothing_succeeds(tiny, tmp_path):
    store, tid, model, tok = tiny
    before = store.list("dataset")
    server = StandIn(model, tok, fail_all=True)
    try:
        path = prompt_file(tmp_path / "p.jsonl", PROMPTS[:3])
        cfg = cfg_for(path, "datagen.backend=openai", f"datagen.server_url={server.url}/v1", "datagen.retries=0")
        with pytest.raises(D.MissingAnswers, match="3 of 3 prompts got no answer after 0 retries.*HTTPError"):
            D.run(cfg, store, tid)
    finally:
        server.close()
    assert store.list("dataset") == before  # no manifest: the failed dataset does not exist


def test_cli_finds_the_configs_target_artifact_and_prints_the_dataset_id(clean_run, capsys):
    store, tid, path, m = clean_run
    sets = [TINY_PRETRAIN, f"dataset.sources=[{{kind: file, path: '{path}'}}]",
            "datagen.max_new_tokens=12", "datagen.batch_size=4"]
    argv = ["--config", "configs/tiny.yaml", "--store", store.uri, "--json"] + [a for s in sets for a in ("--set", s)]
    assert D.main(argv) == 0
    new_id = json.loads(capsys.readouterr().out)["id"]
    assert store.exists("dataset", new_id) and store.manifest("dataset", new_id).inputs == {"target": tid}


def test_sampling_is_seeded(tiny):
    _, _, model, tok = tiny
    cfg = load_config("configs/tiny.yaml", ["datagen.temperature=1.0", "datagen.max_new_tokens=12",
                                            "datagen.batch_size=4"])
    prompts = [{"id": f"p{i}", "source": "test", "messages": [{"role": "user", "content": p}]}
               for i, p in enumerate(PROMPTS[:4])]
    a, _ = D.generate_chunk(prompts, tok, cfg.datagen, model=model, seed=5)
    b, _ = D.generate_chunk(prompts, tok, cfg.datagen, model=model, seed=5)
    c, _ = D.generate_chunk(prompts, tok, cfg.datagen, model=model, seed=6)
    assert a == b and a != c


def test_batch_size_changes_the_dataset_id_only_when_sampling():
    prompts = [{"id": "p0", "source": "stdlib", "messages": [{"role": "user", "content": "Hi?"}]}]

    def ident(*overrides):
        return D.dataset_identity(load_config("configs/tiny.yaml", list(overrides)), prompts, 64)

    assert ident("datagen.batch_size=8") == ident("datagen.batch_size=32")     # greedy: same answers
    assert ident("datagen.max_new_tokens=8") != ident("datagen.max_new_tokens=9")
    assert (ident("datagen.temperature=1.0", "datagen.batch_size=8")
            != ident("datagen.temperature=1.0", "datagen.batch_size=32"))


def test_the_default_decoder_stays_out_of_the_dataset_id():
    """`datagen.decoder: auto` (the default) leaves the ids of datasets made before the field existed; an
    explicit decoder enters the id; an unknown one is refused."""
    prompts = [{"id": "p0", "source": "stdlib", "messages": [{"role": "user", "content": "Hi?"}]}]

    def ident(*overrides):
        return D.dataset_identity(load_config("configs/tiny.yaml", list(overrides)), prompts, 64)

    assert "decoder" not in ident()["datagen"] and ident() == ident("datagen.decoder=auto")
    assert ident("datagen.decoder=engine") != ident() != ident("datagen.decoder=loop")
    with pytest.raises(ConfigError, match="datagen.decoder"):
        ident("datagen.decoder=fast")


def test_a_local_dataset_file_is_part_of_the_id_by_its_bytes(tmp_path):
    """Issue 11: the bytes of a `file` source are in the dataset id (hashed once per file version), even
    where the prompts parse the same; the OpenAI server's address never is."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"id": "a", "messages": [{"role": "user", "content": "Hi?"}]}\n')
    prompts = [{"id": "a", "source": "file", "messages": [{"role": "user", "content": "Hi?"}]}]

    def ident(*overrides):
        return D.dataset_identity(load_config("configs/tiny.yaml", [f"dataset.sources=[{{kind: file, path: {data}}}]",
                                                                     *overrides]), prompts, 64)

    before = ident()
    assert before["files_sha256"] == {str(data): sha256_file(data)}
    data.write_text(data.read_text().replace('"id": "a"', '"id":\t"a"'))   # same size, same rows
    assert ident() != before and ident()["prompts_sha256"] == before["prompts_sha256"]
    assert (ident("datagen.temperature=1.0", "datagen.backend=openai", "datagen.server_url=http://u:SECRET@h:1")
            == ident("datagen.temperature=1.0", "datagen.backend=openai", "datagen.server_url=http://other:2"))
