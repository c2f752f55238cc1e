"""steps/lib/reference/server.py and serving.start/run: real processes, real HTTP on 127.0.0.1.

The world: a "bigram" tiny Llama target (decoder layers add nothing: o_proj and down_proj zero,
orthonormal embeddings, so the next token is B(x)) with a byte-level ChatML tokenizer, and a
hand-built copying draft (tests/builders.py, as in tests/unit/test_engine.py) that knows B∘B through `fc`,
written as a `draft` artifact and exported by steps.export. Its d_1 is always right, so live τ is
well above 1 with EAGLE3 and collapses with EAGLE (fc skipped: F1 for real).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from steps import serve
from steps.lib import formats
from steps.lib.checks.tau import ZERO_ACCEPTANCE_TAU
from steps.lib.data.prompts import held_out_prompts
from steps.lib.formats.sglang_loader import load_sglang_draft
from steps.lib.http import post_json
from steps.lib.metrics import AcceptStats, acceptance_length_from_requests
from steps.lib.model.reference_engine import Engine
from steps.lib.reference.server import HANG_ENV
from steps.lib.serving import launch as launching
from steps.lib.serving import start as serving
from tests.builders import bigram_world, free_port, load_factor, scripted_totals
from tests.conftest import process_alive

LAYER_IDS, K = [1, 2, 3], 3
#: the retry must load within it: ~20 s on a quiet 2-core machine, scaled by the machine's load when the
#: module starts (CI builds images on the same cores)
F6_TIMEOUT_S = int(40 * load_factor())
# f6_run is the suite's one live CUDA-graph hang (the serve step on the reference engine, waited out): the
# failure catalogue and tests/unit/test_serve.py use tests/fake_sglang.py, which hangs without loading a model.
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
pytestmark = pytest.mark.usefixtures("one_thread")


def get(url: str):
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.status, json.loads(r.read())


def post(url: str, body: dict):
    return post_json(url, body, timeout_s=120)


# --- fixtures -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return bigram_world(tmp_path_factory.mktemp("refserver"), free_port(), num_steps=K, layer_ids=LAYER_IDS)


@pytest.fixture(scope="module")
def f6_run(world):
    """serve.run with the F6 hang, in the background: its first attempt must time out, so it overlaps the rest."""
    cfg = world["cfg"].model_copy(update={"serve": world["cfg"].serve.model_copy(
        update={"port": free_port(), "startup_timeout_s": F6_TIMEOUT_S})})
    result: dict = {}

    def target():
        try:
            result["manifest"] = serve.run(cfg, world["store"], world["export_id"], world["target_id"],
                                           env={**ENV, HANG_ENV: "1"})
        except Exception as err:  # noqa: BLE001 — reported by the test that joins
            result["error"] = err
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result, cfg


@pytest.fixture(scope="module")
def eagle_server(world, f6_run, tmp_path_factory):
    """The same draft behind --speculative-algorithm EAGLE (preflight bypassed on purpose); loads in parallel."""
    port = free_port()
    cmd = serving.build_sglang_command(world["cfg"], target_path=world["target_dir"], draft_dir=world["draft_dir"],
                                     port=port, launcher=serving.LAUNCHERS["reference"])
    cmd[cmd.index("EAGLE3")] = "EAGLE"
    log = tmp_path_factory.mktemp("eagle") / "eagle.log"
    with log.open("wb") as f:
        process = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **ENV},
                                   start_new_session=True)
    server = launching.Server(process, cmd, log, f"http://127.0.0.1:{port}/health_generate")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def spec_server(world, eagle_server):
    """serving.start: preflight, launch, smoke test, serve artifact; the server keeps running."""
    manifest, server = serving.start(world["cfg"], world["store"], world["export_id"], world["target_id"], env=ENV)
    yield manifest, server
    server.stop()


# --- tests --------------------------------------------------------------------------------------------

def test_serve_start_records_the_command_attempts_endpoint_logs_and_smoke_tau(world, spec_server):
    manifest, server = spec_server
    assert manifest.kind == "serve" and manifest.inputs == {"export": world["export_id"],
                                                            "target": world["target_id"]}
    assert "-m steps.lib.reference.server" in manifest.meta["command"]
    assert "--speculative-algorithm EAGLE3" in manifest.meta["command"]
    assert [a["outcome"] for a in manifest.meta["attempts"]] == ["healthy"]
    assert manifest.meta["endpoint"] == server.base_url == f"http://127.0.0.1:{world['cfg'].serve.port}"
    assert manifest.metrics["smoke_tau"] > ZERO_ACCEPTANCE_TAU
    log = world["store"].fetch_file("serve", manifest.id, manifest.meta["logs"][0]).read_text()
    assert "listening on" in log and "ready in" in log


def test_a_second_server_while_the_configured_port_is_taken_serves_on_a_free_one(world, spec_server):
    """Two pipelines on one machine share a config's serve ports: the second start must neither fail nor
    take the first one's health answer as its own."""
    first = spec_server[1]
    assert first.base_url.endswith(f":{world['cfg'].serve.port}")
    manifest, second = serving.start(world["cfg"], world["store"], world["export_id"], world["target_id"],
                                     baseline=True, env=ENV)
    try:
        assert second.base_url != first.base_url and manifest.meta["endpoint"] == second.base_url
        assert f"--port {second.base_url.rsplit(':', 1)[1]}" in manifest.meta["command"]
        assert get(f"{second.base_url}/server_info")[1]["speculative_algorithm"] != "EAGLE3"   # the baseline
        assert get(f"{first.base_url}/server_info")[1]["speculative_algorithm"] == "EAGLE3"    # untouched
    finally:
        second.stop()


def test_server_info_and_generate_speak_sglangs_fields(world, spec_server):
    _, server = spec_server
    status, info = get(f"{server.base_url}/server_info")
    assert status == 200 and info["engine"] == "reference" and info["version"].startswith("reference-")
    assert info["speculative_algorithm"] == "EAGLE3" and info["speculative_num_steps"] == K
    assert info["speculative_num_draft_tokens"] == K + 1 and info["speculative_eagle_topk"] == 1
    assert info["speculative_draft_model_path"] == str(world["draft_dir"])
    assert info["enable_metrics"] is True and info["tp"] == "1"          # other SGLang flags recorded
    assert info["draft_load_report"]["dropped"] == [] and "internal_states" in info
    assert get(f"{server.base_url}/health_generate")[0] == 200
    r = post(f"{server.base_url}/generate", {"text": "def add(a, b):", "sampling_params":
                                                 {"max_new_tokens": 12, "temperature": 0}})
    meta = r["meta_info"]
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "e2e_latency", "spec_verify_ct",
                "spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_accept_rate", "spec_accept_length",
                "spec_correct_drafts_histogram"):
        assert key in meta, key
    assert meta["completion_tokens"] == len(r["output_ids"]) <= 12
    assert meta["spec_num_proposed_drafts"] == meta["spec_verify_ct"] * K
    assert sum(meta["spec_correct_drafts_histogram"]) == meta["spec_verify_ct"]
    assert meta["spec_num_correct_drafts"] == sum(j * c for j, c in enumerate(meta["spec_correct_drafts_histogram"]))
    batched = post(f"{server.base_url}/generate", {"input_ids": [[5, 6, 7], [8, 9]],
                                                   "sampling_params": {"max_new_tokens": 5}})
    assert isinstance(batched, list) and [b["meta_info"]["prompt_tokens"] for b in batched] == [3, 2]


def test_speculative_output_equals_plain_output_and_live_tau_matches_offline(world, spec_server):
    """The issue's requirement: the healthy drafter served live gives τ within 5% of offline τ on the same prompts."""
    _, server = spec_server
    cfg = world["cfg"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(world["target_dir"], dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(world["target_dir"])
    draft, _ = load_sglang_draft(world["draft_dir"], target=target)
    engine = Engine(target, tok, draft, layer_ids=formats.sglang.sglang_layer_ids(world["draft_dir"]), num_steps=K)
    prompts = held_out_prompts(cfg, tok)
    live = [post(f"{server.base_url}/generate", {"input_ids": ids, "sampling_params":
                                                 {"max_new_tokens": cfg.verify.max_new_tokens, "temperature": 0}})
            for _, ids in prompts]
    offline = AcceptStats(K)
    for (_, ids), r in zip(prompts, live, strict=True):       # what verify.measure does, keeping the outputs
        spec, stats = engine.generate(ids, cfg.verify.max_new_tokens, tok.eos_token_id)
        offline.merge(stats)
        assert r["output_ids"] == spec == engine.generate_plain(ids, cfg.verify.max_new_tokens, tok.eos_token_id)
    live_tau = acceptance_length_from_requests([r["meta_info"] for r in live])
    print(f"live τ {live_tau:.3f}  offline τ {offline.tau:.3f}")
    assert offline.tau >= 2.0
    assert abs(live_tau - offline.tau) <= 0.05 * offline.tau


def test_live_tau_is_exactly_what_the_scripted_draft_gives(world, spec_server):
    """τ computed from the script, not a bound: every request's spec_num_correct_drafts and spec_verify_ct
    equal the counts the copying draft must give on the target's own greedy continuation."""
    _, server = spec_server
    cfg = world["cfg"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(world["target_dir"])
    prompts = [ids for _, ids in held_out_prompts(cfg, tok)]
    max_new = cfg.verify.max_new_tokens
    expected = scripted_totals(world["target_dir"], prompts, K, max_new, tok.eos_token_id)
    live = []
    for ids in prompts:
        meta = post(f"{server.base_url}/generate", {"input_ids": ids, "sampling_params":
                                                    {"max_new_tokens": max_new, "temperature": 0}})["meta_info"]
        live.append((meta["spec_num_correct_drafts"], meta["spec_verify_ct"]))
    assert live == expected
    accepted, steps = map(sum, zip(*expected, strict=True))
    tau = (accepted + steps) / steps
    print(f"live τ = scripted τ = {tau:.4f}")
    assert 1.0 < tau < K + 1          # the script is neither trivially rejected nor a fixed point throughout


def test_v1_completions_streams_the_same_text_as_the_non_streaming_answer(spec_server):
    _, server = spec_server
    body = {"prompt": "import os\n", "max_tokens": 10, "temperature": 0}
    whole = post(f"{server.base_url}/v1/completions", body)
    req = urllib.request.Request(f"{server.base_url}/v1/completions",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert len(chunks) >= 2
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] > 0


def test_temperature_above_zero_is_refused_not_silently_greedy(spec_server):
    _, server = spec_server
    with pytest.raises(urllib.error.HTTPError) as err:
        post(f"{server.base_url}/generate", {"text": "x", "sampling_params": {"temperature": 1.0}})
    assert err.value.code == 400 and "greedily" in err.value.read().decode()


def test_an_out_of_vocabulary_token_id_is_a_400_naming_it_not_an_empty_reply(spec_server):
    """Issue 11, finding 9: on /generate and on a streamed /v1/completions (refused before its 200)."""
    _, server = spec_server
    for url, body in ((f"{server.base_url}/generate", {"input_ids": [1, 2, 10**6]}),
                      (f"{server.base_url}/v1/completions", {"prompt": [1, -5], "stream": True})):
        with pytest.raises(urllib.error.HTTPError) as err:
            post(url, body)
        bad = "1000000" if "generate" in url else "-5"
        assert err.value.code == 400 and f"token id {bad}, outside the target's vocab [0, " in err.value.read().decode()


def test_eagle_algorithm_skips_fc_and_live_tau_collapses_f1(world, spec_server, eagle_server):
    """F1 for real: preflight refuses EAGLE; served anyway, the same draft accepts almost nothing."""
    _, good = spec_server
    bad = eagle_server
    with pytest.raises(serving.PreflightError, match="F1"):
        serving.assert_preflight(serving.preflight(world["draft_dir"], bad.command, target_config={}))
    deadline = time.monotonic() + 90
    while launching.health_status(bad.health_url, 5) != 200:
        assert bad.process.poll() is None and time.monotonic() < deadline, bad.log_path.read_text()
        time.sleep(0.5)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 3, 77]]
    body = {"sampling_params": {"max_new_tokens": 24}}
    tau_bad = acceptance_length_from_requests(
        [post(f"{bad.base_url}/generate", {**body, "input_ids": p})["meta_info"] for p in prompts])
    tau_good = acceptance_length_from_requests(
        [post(f"{good.base_url}/generate", {**body, "input_ids": p})["meta_info"] for p in prompts])
    assert get(f"{bad.base_url}/server_info")[1]["speculative_algorithm"] == "EAGLE"
    with pytest.raises(serving.SmokeTestError, match="F1"):
        serving.smoke_test(world["cfg"], bad.base_url, prompts[0])
    print(f"EAGLE τ {tau_bad:.3f}  EAGLE3 τ {tau_good:.3f}")
    assert tau_bad <= 1.1 < 2.0 <= tau_good
    assert bad.stop() == 0                        # SIGTERM: a graceful exit


def processes_with(*argv_words: str) -> list[int]:
    """Pids of the live processes whose argv holds every word in `argv_words`."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(w.encode() in argv for w in argv_words) and process_alive(int(proc.name)):
            found.append(int(proc.name))
    return found


def test_eaglenest_serve_launches_the_reference_engine_answers_and_stops_on_sigterm(world, tmp_path):
    """`eaglenest serve --draft ID` without --print-command: the reference engine (serve.engine) starts on the
    derived argv, answers /health and a completion, and SIGTERM to the CLI stops it cleanly: no process is left."""
    port = free_port()
    out = tmp_path / "cli.out"
    with out.open("w") as f:
        cli = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--config", "tiny", "--store",
                                world["store"].uri, "--draft", world["export_id"], "--port", str(port),
                                "--log-dir", str(tmp_path / "logs")], stdout=f, stderr=subprocess.STDOUT,
                               env={**os.environ, **ENV}, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while "serving at" not in out.read_text():
            assert cli.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.5)
        assert get(f"{base}/health")[0] == 200
        _, info = get(f"{base}/server_info")
        assert info["engine"] == "reference" and info["speculative_algorithm"] == "EAGLE3"
        assert info["speculative_draft_model_path"] == str(world["draft_dir"])
        assert info["model_path"] == str(world["target_dir"])
        answer = post(f"{base}/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0})
        assert answer["choices"][0]["text"] and 0 < answer["usage"]["completion_tokens"] <= 8
        [server_pid] = processes_with("steps.lib.reference.server", str(port))
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=60) == 0, out.read_text()      # the server's own exit code: a graceful stop
    finally:
        if cli.poll() is None:
            cli.kill()
    printed = out.read_text()
    assert f"serving at {base}" in printed and '"outcome": "healthy"' in printed
    assert launching.health_status(f"{base}/health", timeout_s=2) is None
    assert processes_with("steps.lib.reference.server", str(port)) == [], f"server {server_pid} outlived the CLI"
    assert (tmp_path / "logs" / "server-attempt1.log").read_text()


def test_a_cuda_graph_hang_times_out_then_serve_run_retries_without_graphs_f6(world, f6_run):
    thread, result, cfg = f6_run
    thread.join(timeout=2 * F6_TIMEOUT_S + 90)
    assert "error" not in result, result.get("error")
    manifest = result["manifest"]
    attempts = manifest.meta["attempts"]
    assert [a["cuda_graph"] for a in attempts] == [True, False]
    assert f"not healthy after {F6_TIMEOUT_S} s" in attempts[0]["outcome"] and attempts[1]["outcome"] == "healthy"
    assert "--cuda-graph-backend-decode disabled" in attempts[1]["command"]
    first_log = world["store"].fetch_file("serve", manifest.id, manifest.meta["logs"][0]).read_text()
    assert "capturing CUDA graphs" in first_log
    assert manifest.metrics["smoke_tau"] > ZERO_ACCEPTANCE_TAU
    assert launching.health_status(f"{manifest.meta['endpoint']}/health", timeout_s=2) is None      # run stopped it
    # the run report shows both starts, from the serve step's record as the pipeline keeps it (flows/step_flows.py)
    from flows.ui import run_report

    record = {"kind": manifest.kind, "id": manifest.id, "uri": "", "seconds": 0, "meta": manifest.meta}
    report = run_report("t", {"serve": record}, dataset=None, decision=None, production=None, plot_png=None,
                        outcome="Completed")
    table = report[report.index("## Server starts"):]
    assert re.search(rf"\n\| True \| failed: \S+ not healthy after {F6_TIMEOUT_S} s[^|\n]*\| [\d.]+ \|\n", table), table
    assert re.search(r"\n\| False \| healthy \| [\d.]+ \|", table), table


def test_unknown_sglang_flags_are_recorded_and_baseline_drops_only_speculative_flags():
    from steps.lib.reference.server import extra_flags, parse_args

    args, extras = parse_args(["--model-path", "m", "--enable-metrics", "--cuda-graph-max-bs-decode", "8",
                               "--context-length=4096", "--tp", "2"])
    assert args.speculative_algorithm is None
    assert extras == {"enable_metrics": True, "cuda_graph_max_bs_decode": "8", "context_length": "4096", "tp": "2"}
    assert extra_flags(["--a", "--b", "x"]) == {"a": True, "b": "x"}
    cmd = ["py", "--model-path", "m", "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
           "--port", "1", "--enable-metrics"]
    assert serving.baseline_command(cmd) == ["py", "--model-path", "m", "--port", "1", "--enable-metrics"]
