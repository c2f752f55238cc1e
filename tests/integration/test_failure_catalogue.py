"""The failure catalogue, live: each row is refused before serving, collapses τ when forced through, and
`eaglenest doctor --server` names it.

One healthy SGLang export is built per module from a target whose draft is known to accept tokens:
a tiny Llama whose decoder layers add nothing except the MLP of decoder layer 1 (so HF
`hidden_states[1]` = the token embedding E[x], `hidden_states[2..4]` = E[x] + f(E[x])), with
orthonormal embeddings, so the next token is a fixed function B(x). The draft is trained on internal
aux layers [1, 2, 3]; its `fc` reads the first aux state (E[x]) and its head scores B(B(x)), so its
first drafted token is always right (τ ≈ 2 with 4 steps; measured in `test_healthy_export_accepts_tokens`).
Every broken variant is that export with one thing wrong. "Forced" means the reference server
(`steps.reference_server`, SGLang's lenient loader rules) is started directly on it, skipping
eaglenest's refusal; live τ is computed client-side from per-request meta_info.

F5 cannot collapse τ on the reference server (it does not model SGLang's context check; real SGLang
refuses to start); the test shows the refusal and doctor's verdict only.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from steps import doctor, formats, serve
from steps.config import find_config, load_config
from steps.draft import DraftConfig, Eagle3Draft
from steps.metrics import acceptance_length_from_requests

V, H, N, STEPS = 272, 288, 4, 4
LAYER_IDS = [1, 2, 3]              # internal; SGLang eagle_config [0, 1, 2]
REPO = Path(__file__).resolve().parents[2]
LAUNCHER = (sys.executable, "-m", "steps.reference_server")
PROMPTS = ["def fib(n):", "The quick brown fox", "import numpy as np", "Hello, world"]
ZERO = doctor.ZERO_ACCEPTANCE_TAU

pytestmark = pytest.mark.timeout(300) if hasattr(pytest.mark, "timeout") else []

# --- the world: target, healthy export, broken variants ------------------------------------------------

def tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    from steps.target import CHATML_TEMPLATE

    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}, merges=[]))
    tk.pre_tokenizer, tk.decoder = ByteLevel(add_prefix_space=False, use_regex=False), decoders.ByteLevel()
    tk.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHATML_TEMPLATE
    return tok

def build_target(root: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=N,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         eos_token_id=tok.eos_token_id, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.o_proj.weight.zero_()          # no attention: the next token depends on x only
            if i != 1:
                layer.mlp.down_proj.weight.zero_()
            else:                                          # layer 1 changes the residual: layers 1 ≠ 2
                layer.mlp.down_proj.weight.mul_(400.0)
        q, _ = torch.linalg.qr(torch.randn(H, H))
        model.model.embed_tokens.weight.copy_(q[:V] * 3.0)
    out = root / "target"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return model, out

def copying_draft(target) -> Eagle3Draft:
    """fc reads hidden_states[1] = E[x_p]; the head scores B(B(x_p)) with B the target's next-token map."""
    with torch.no_grad():
        bigram = target(input_ids=torch.arange(V)[:, None]).logits[:, 0].argmax(-1)     # B[x]
    emb = target.model.embed_tokens.weight.detach()
    normed = emb / emb.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    vocab = torch.unique(bigram)
    torch.manual_seed(1)
    draft = Eagle3Draft(DraftConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=H // 4, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
                                    vocab_size=V, draft_vocab_size=len(vocab), target_hidden_size=H, num_aux=3)).eval()
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

def export_sglang(out: Path, draft: Eagle3Draft, *, layer_ids=LAYER_IDS, **config_edits) -> Path:
    config = formats.sglang_config(draft.cfg.to_dict(), layer_ids=layer_ids, max_position_embeddings=512,
                                   dtype="float32")
    config.update(config_edits)
    return formats.write_engine_dir(out, "sglang", draft.state_dict(), config, dtype="float32")

def variant(world, name: str, *, rename=None, drop=(), **config_edits) -> Path:
    """The healthy export with one thing wrong (weights renamed / dropped, config fields edited)."""
    src, out = world["healthy"], world["export"] / name
    out.mkdir()
    tensors = {(rename(k) if rename else k): v for k, v in load_file(str(src / "model.safetensors")).items()
               if k not in drop}
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    for key, value in config_edits.items():
        if key == "eagle_ids":
            config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = value
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out

@pytest.fixture(scope="module")
def world(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("catalogue")
    target, tdir = build_target(root)
    export = root / "export"
    healthy = export_sglang(export / "healthy", copying_draft(target))
    # the export manifest records the trained layers (internal), as steps.export does
    (export / "manifest.json").write_text(json.dumps({"meta": {"internal_layer_ids": LAYER_IDS}}))
    cfg = load_config(find_config("tiny"), [f"serve.num_steps={STEPS}", f"serve.num_draft_tokens={STEPS + 1}"])
    return {"root": root, "target": tdir, "tcfg": json.loads((tdir / "config.json").read_text()),
            "export": export, "healthy": healthy, "cfg": cfg}

# --- serving helpers ------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def command(world, draft: Path, port: int, *, algorithm: str | None = None, disable_cuda_graph=False) -> list[str]:
    cmd = serve.build_sglang_command(world["cfg"], target_path=world["target"], draft_dir=draft, port=port,
                                     disable_cuda_graph=disable_cuda_graph, launcher=LAUNCHER)
    if algorithm:                                          # forced: the flag typed by hand
        cmd[cmd.index("--speculative-algorithm") + 1] = algorithm
    return cmd

def start(world, draft: Path, name: str, **kw) -> serve.Server:
    port = free_port()
    env = {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return serve.launch(command(world, draft, port, **kw), log_path=world["root"] / f"{name}.log",
                        health_url=f"http://127.0.0.1:{port}/health_generate", timeout_s=90, env=env)

def live_tau(server: serve.Server) -> float:
    metas = []
    for text in PROMPTS:
        body = json.dumps({"text": text, "sampling_params": {"max_new_tokens": 32, "temperature": 0,
                                                             "ignore_eos": True}}).encode()
        req = urllib.request.Request(f"{server.base_url}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            metas.append(json.loads(r.read())["meta_info"])
    return acceptance_length_from_requests(metas)

def doctor_on(world, draft: Path, server: serve.Server | None = None, **kw) -> dict[str, doctor.Finding]:
    findings = doctor.run(draft, target=world["target"], server=server.base_url if server else None, **kw)
    return {f.id: f for f in findings}

def refused(world, draft: Path, row: str, *, algorithm: str | None = None) -> str:
    """eaglenest's own gates: the export's strict check, then serve's preflight. Returns the messages."""
    strict = [str(f) for f in formats.check_engine_dir(draft, "sglang", expect={"layer_ids": LAYER_IDS})]
    pre = serve.preflight(draft, command(world, draft, 1, algorithm=algorithm), target_config=world["tcfg"],
                          env={})
    pre = [str(f) for f in pre if f.status == "fail"]
    messages = "\n".join(strict + pre)
    assert f"[{row}" in messages or f"{row} FAIL" in messages, messages
    return messages

# --- the healthy baseline --------------------------------------------------------------------------------

def test_healthy_export_accepts_tokens(world):
    assert formats.check_engine_dir(world["healthy"], "sglang", expect={"layer_ids": LAYER_IDS}) == []
    assert not [f for f in serve.preflight(world["healthy"], command(world, world["healthy"], 1),
                                           target_config=world["tcfg"], env={}) if f.status == "fail"]
    with start(world, world["healthy"], "healthy") as server:
        tau = live_tau(server)
        found = doctor_on(world, world["healthy"], server)
    print(f"healthy live τ = {tau:.2f}")
    assert tau > 1.5, tau
    assert not [f for f in found.values() if f.status == "fail"], [str(f) for f in found.values()]
    assert found["F9"].status == "pass" and found["F1"].status == "pass"

# --- one test per row ---------------------------------------------------------------------------------------

def test_f1_eagle_algorithm_with_an_eagle3_draft(world):
    msg = refused(world, world["healthy"], "F1", algorithm="EAGLE")
    assert "EAGLE3" in msg
    with start(world, world["healthy"], "f1", algorithm="EAGLE") as server:
        tau = live_tau(server)
        found = doctor_on(world, world["healthy"], server)
    assert tau <= ZERO, tau
    assert found["F1"].status == "fail" and "EAGLE3" in found["F1"].fix
    assert found["F9"].status == "fail" and "serving is misconfigured, not training" in found["F9"].evidence

def test_f2_a_draft_model_prefix_leaves_the_draft_random(world):
    broken = variant(world, "f2", rename=lambda k: "draft_model." + k)
    msg = refused(world, broken, "F2")
    assert "draft_model." in msg
    with start(world, broken, "f2") as server:
        tau = live_tau(server)
        found = doctor_on(world, broken, server)
    assert tau <= ZERO, tau
    assert found["F2"].status == "fail" and "draft_model." in found["F2"].fix
    assert "F2" in found["F9"].evidence and found["F9"].status == "fail"

def test_f3_a_missing_d2t_maps_draft_ids_as_target_ids(world):
    broken = variant(world, "f3", drop=("d2t",))
    refused(world, broken, "F3")
    with start(world, broken, "f3") as server:
        tau = live_tau(server)
        found = doctor_on(world, broken, server)
    assert tau <= ZERO, tau
    assert found["F3"].status == "fail" and "d2t" in found["F3"].fix
    assert "F3" in found["F9"].evidence

def test_f4_ids_in_the_vllm_convention_capture_the_wrong_layers(world):
    broken = variant(world, "f4", eagle_ids=LAYER_IDS)        # SGLang adds +1: captures internal [2, 3, 4]
    refused(world, broken, "F4")
    with start(world, broken, "f4") as server:
        tau = live_tau(server)
        found = doctor_on(world, broken, server)
    assert tau <= ZERO, tau
    assert found["F4"].status == "fail" and found["F4"].fix
    assert found["F9"].status == "fail" and "F4" in found["F9"].evidence

def test_f5_a_draft_context_shorter_than_the_target(world):
    broken = variant(world, "f5", max_position_embeddings=64)
    msg = refused(world, broken, "F5")
    assert "64" in msg
    found = doctor_on(world, broken)
    assert found["F5"].status == "fail" and "512" in found["F5"].fix

def test_f6_a_cuda_graph_hang_is_retried_without_graphs_and_doctor_reports_it(world, monkeypatch):
    monkeypatch.setenv("EAGLENEST_REFERENCE_HANG_WITH_CUDA_GRAPH", "1")
    port = free_port()
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with pytest.raises(serve.ServerStartError, match="F6"):       # forced: no retry → never healthy
        serve.launch(command(world, world["healthy"], port), log_path=world["root"] / "f6-forced.log",
                     health_url=f"http://127.0.0.1:{port}/health_generate", timeout_s=8, env=env)
    server = serve.launch_with_fallback(
        lambda off: command(world, world["healthy"], port, disable_cuda_graph=off), log_dir=world["root"] / "f6",
        health_url=f"http://127.0.0.1:{port}/health_generate", timeout_s=20, env=env)
    with server:
        assert [a["cuda_graph"] for a in server.attempts] == [True, False]
        found = doctor_on(world, world["healthy"], server, serve_record=server.attempts)
    assert found["F6"].status == "warn" and "disabled" in found["F6"].evidence
    assert "cuda_graph=True" in found["F6"].evidence

def test_f7_a_null_draft_vocab_size_is_refused_and_the_forced_server_fails_loudly(world):
    broken = variant(world, "f7", draft_vocab_size=None)
    refused(world, broken, "F7")
    with pytest.raises(serve.ServerStartError, match="exited"):
        start(world, broken, "f7")
    assert "shape" in (world["root"] / "f7.log").read_text()
    found = doctor_on(world, broken)
    assert found["F7"].status == "fail" and "null" in found["F7"].evidence

def test_doctor_cli_against_a_live_server_exits_nonzero_and_prints_json(world, capsys):
    with start(world, world["healthy"], "cli", algorithm="EAGLE") as server:
        rc = doctor.main([str(world["healthy"]), "--target", str(world["target"]), "--server", server.base_url,
                          "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["ok"] is False
    assert {c["id"] for c in out["checks"] if c["status"] == "FAIL"} >= {"F1", "F9"}
    assert os.environ.get("EAGLENEST_REFERENCE_HANG_WITH_CUDA_GRAPH") != "1"
