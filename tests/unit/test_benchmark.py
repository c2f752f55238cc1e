"""steps/benchmark.py: baseline vs speculative against two real reference servers on 127.0.0.1.

The world is the one of tests/unit/test_reference_server.py (duplicated: test files do not share
fixtures): a "bigram" tiny Llama target and a hand-built copying draft, exported by steps.export,
so the speculative server really accepts drafts (τ well above 1).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from steps import benchmark, export
from steps.config import BenchmarkConfig, parse_config
from steps.draft import DraftConfig, Eagle3Draft
from steps.store import open_store

H, LAYERS, LAYER_IDS, K = 288, 4, [1, 2, 3], 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bigram_target_dir(root: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from steps.target import CHATML_TEMPLATE

    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}, merges=[]))
    tk.pre_tokenizer, tk.decoder = ByteLevel(add_prefix_space=False, use_regex=False), decoders.ByteLevel()
    tk.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHATML_TEMPLATE
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=H, intermediate_size=256,
                                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512, eos_token_id=tok.eos_token_id,
                                         tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        q, _ = torch.linalg.qr(torch.randn(H, H))
        model.model.embed_tokens.weight.copy_(q[:len(tok)] * 3.0)
    out = root / "target"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def copying_draft(target_dir: Path) -> Eagle3Draft:
    """out_hidden = fc(aux) = Q·E[x_p]; lm_head scores B(B(x_p)); vocab = the image of B."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    V = target.config.vocab_size
    emb = target.model.embed_tokens.weight.detach()
    normed = emb / emb.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    bigram = (target.lm_head.weight.detach() @ normed.T).argmax(0)
    vocab = torch.unique(bigram)
    torch.manual_seed(1)
    draft = Eagle3Draft(DraftConfig(hidden_size=H, intermediate_size=256, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=H // 4, rms_norm_eps=1e-6, rope_theta=10000.0,
                                    max_position_embeddings=512, vocab_size=V, draft_vocab_size=len(vocab),
                                    target_hidden_size=H, num_aux=len(LAYER_IDS))).eval()
    q, _ = torch.linalg.qr(torch.randn(H, H))
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(emb)
        draft.fc.weight.zero_()
        draft.fc.weight[:, :H] = q
        draft.midlayer.self_attn.o_proj.weight.zero_()
        draft.midlayer.mlp.down_proj.weight.zero_()
        head = torch.zeros(len(vocab), H)
        for x in range(V):
            head[torch.searchsorted(vocab, bigram[bigram[x]])] += q @ normed[x]
        draft.lm_head.weight.copy_(head)
        draft.d2t.copy_(vocab - torch.arange(len(vocab)))
        draft.t2d[vocab] = True
    return draft


def put_draft(store, draft: Eagle3Draft, n_layers: int) -> str:
    writer = store.begin("draft", "copying", step="train")
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, str(writer.path("model.safetensors")))
    meta = {**draft.cfg.to_dict(), "layer_ids": LAYER_IDS,
            "target": {"num_hidden_layers": n_layers, "hidden_size": H, "vocab_size": draft.cfg.vocab_size,
                       "max_position_embeddings": 512, "name": "bigram"}}
    writer.path("draft_config.json").write_text(json.dumps(meta))
    writer.commit(meta=meta)
    return "copying"


def build_world(root: Path, port: int) -> dict:
    from steps import target

    tdir = bigram_target_dir(root)
    store = open_store(f"file://{root}/store")
    cfg = parse_config({"name": "t", "target": {"source": "hf_dir", "path": str(tdir)},
                        "extract": {"aux_layer_ids": LAYER_IDS}, "export": {"dtype": "float32"},
                        "verify": {"num_steps": K, "num_prompts": 3, "max_new_tokens": 24},
                        "benchmark": {"max_new_tokens": 24},
                        "serve": {"engine": "reference", "port": port, "num_steps": K, "num_draft_tokens": K + 1,
                                  "startup_timeout_s": 60}})
    target_id = target.run(cfg, store).id
    export_id = export.run(cfg, store, put_draft(store, copying_draft(tdir), LAYERS), target_id).id
    return {"store": store, "cfg": cfg, "target_id": target_id, "export_id": export_id, "target_dir": tdir,
            "draft_dir": export.export_dir(store, export_id, "sglang")}


def free_ports() -> int:
    """A port p with p + 1 also free (the benchmark starts the baseline on serve.port + 1)."""
    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two adjacent free ports")


@pytest.fixture(scope="module")
def bench(tmp_path_factory, monkeypatch_module):
    world = build_world(tmp_path_factory.mktemp("bench"), free_ports())
    cfg = world["cfg"].model_copy(update={"verify": world["cfg"].verify.model_copy(update={"num_prompts": 2})})
    m = benchmark.run(cfg, world["store"], world["export_id"], world["target_id"])
    return {**world, "cfg": cfg, "manifest": m}


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    for k in ("OMP_NUM_THREADS", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        mp.setenv(k, "1")
    yield mp
    mp.undo()


def test_benchmark_json_has_speed_tau_latency_settings_servers_and_hardware(bench):
    m, store = bench["manifest"], bench["store"]
    assert m.kind == "benchmark" and m.inputs == {"export": bench["export_id"], "target": bench["target_id"]}
    report = json.loads(store.fetch_file("benchmark", m.id, "benchmark.json").read_text())
    assert report["settings"]["batch_sizes"] == [1, 4] and report["settings"]["temperatures"] == [0.0]
    assert report["prompts"] == ["mtbench-81", "mtbench-82", "humaneval-0", "humaneval-1", "humaneval-2",
                                 "humaneval-3"]
    spec, base = report["servers"]["speculative"], report["servers"]["baseline"]
    assert spec["version"].startswith("reference-") and spec["speculative_algorithm"] == "EAGLE3"
    assert spec["speculative_num_steps"] == K and spec["speculative_eagle_topk"] == 1
    assert spec["speculative_num_draft_tokens"] == K + 1 and base["speculative_algorithm"] is None
    assert report["hardware"]["cpu"] and "torch" in report["hardware"]
    r = report["results"]["0.0"]
    for batch in ("1", "4"):
        for side in ("baseline", "speculative"):
            b = r[side]["batches"][batch]
            assert b["requests"] == 6 and b["completion_tokens"] == 6 * bench["cfg"].benchmark.max_new_tokens
            assert b["tokens_per_s"] > 0
    assert r["baseline"]["acceptance"] is None                  # no draft, no spec_* meta_info
    acc = r["speculative"]["acceptance"]
    assert 2.0 <= acc["tau"] <= K + 1 and len(acc["per_position_acceptance"]) == K
    assert acc["per_position_acceptance"][0] == 1.0             # the copying draft's d_1 is always right
    assert acc["tau"] == pytest.approx((acc["accepted_drafts"] + acc["verify_steps"]) / acc["verify_steps"])
    assert r["speculative"]["latency"]["ttft_s"] > 0 and r["speculative"]["latency"]["itl_s"] > 0
    assert m.metrics["tau"] == acc["tau"] and m.metrics["speedup"] > 0
    print(f"τ {m.metrics['tau']:.3f}  baseline {m.metrics['baseline_tokens_per_s']:.1f} tok/s  "
          f"spec {m.metrics['spec_tokens_per_s']:.1f} tok/s  speedup {m.metrics['speedup']:.2f}  "
          f"TTFT {m.metrics['spec_ttft_s'] * 1000:.0f} ms  ITL {m.metrics['spec_itl_s'] * 1000:.1f} ms")


def test_report_markdown_and_png_are_written(bench):
    m, store = bench["manifest"], bench["store"]
    md = store.fetch_file("benchmark", m.id, "report.md").read_text()
    assert "Live τ" in md and "| 0.0 | 1 |" in md and "| 0.0 | 4 |" in md and "humaneval-0" in md
    png = store.fetch_file("benchmark", m.id, "benchmark.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_the_servers_it_started_are_stopped_and_a_rerun_reuses_the_artifact(bench):
    from steps import serve

    m = bench["manifest"]
    spec_url = m.meta["servers"]["speculative"]["url"]
    assert serve.health_status(f"{spec_url}/health", timeout_s=2) is None
    again = benchmark.run(bench["cfg"], bench["store"], bench["export_id"], bench["target_id"])
    assert again.id == m.id and again.created == m.created


def test_pinned_prompts_are_deterministic_and_match_verify_selection(bench):
    from transformers import AutoTokenizer

    from steps import verify

    tok = AutoTokenizer.from_pretrained(bench["target_dir"])
    s = BenchmarkConfig(num_code_prompts=2)
    a, b = benchmark.pinned_prompts(bench["cfg"], s, tok), benchmark.pinned_prompts(bench["cfg"], s, tok)
    assert a == b and [p["id"] for p in a] == ["mtbench-81", "mtbench-82", "humaneval-0", "humaneval-1"]
    assert [(p["id"], p["input_ids"]) for p in a[:2]] == verify.held_out_prompts(bench["cfg"], tok)
