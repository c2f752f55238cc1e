"""steps/serve.py: the derived launch command, the preflight refusals (F1, F4, F5, F7), and the
launch / health deadline / CUDA-graph retry / stop lifecycle (F6) against a real local HTTP server."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from steps import serve
from steps.lib import formats
from steps.lib.checks.context import LONGER_CONTEXT_ENV
from steps.lib.checks.finding import Finding
from steps.lib.config import PipelineConfig, find_config, load_config, parse_config
from steps.lib.serving import launch as launching
from steps.lib.serving import start as serving
from tests.builders import free_port, load_factor
from tests.conftest import process_alive

#: the fast stand-in for SGLang's start-up (a script; see its docstring)
FAKE_SERVER = Path(__file__).resolve().parents[1] / "fake_sglang.py"


#: a start-up deadline the stand-in's hang must outlast and its healthy start must meet (~0.1 s quiet)
HANG_S = round(2 * load_factor())


def draft_config(**overrides) -> dict:
    """An exported SGLang draft config.json, built by the export's own builder; `...` deletes a field."""
    draft = {"hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 2048,
             "draft_vocab_size": 1024, "target_hidden_size": 128}
    cfg = formats.sglang.build_config(draft, layer_ids=[1, 2, 3], max_position_embeddings=2048, dtype="bfloat16")
    cfg.update(overrides)
    return {k: v for k, v in cfg.items() if v is not ...}


TARGET = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "hidden_size": 128, "vocab_size": 2048,
          "max_position_embeddings": 2048}


def write_draft(tmp_path: Path, **overrides) -> Path:
    d = tmp_path / "sglang"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(draft_config(**overrides)))
    return d


def pipeline_config(**target_and_serve) -> PipelineConfig:
    target = {"source": "tiny", **target_and_serve.pop("target", {})}
    return parse_config({"name": "t", "target": target, "serve": target_and_serve.pop("serve", {}),
                         "verify": target_and_serve.pop("verify", {})})


def option(cmd: list[str], flag: str) -> str:
    assert cmd.count(flag) == 1, f"{flag} appears {cmd.count(flag)} times in {shlex.join(cmd)}"
    return cmd[cmd.index(flag) + 1]


# --- the command ----------------------------------------------------------------------------------

def test_command_derives_eagle3_and_every_speculative_flag_from_the_draft_and_config(tmp_path):
    draft = write_draft(tmp_path)
    cfg = pipeline_config(serve={"num_steps": 5, "eagle_topk": 1, "num_draft_tokens": 6, "cuda_graph_max_bs": 16})
    cmd = serving.build_sglang_command(cfg, target_path="/models/target", draft_dir=draft)
    assert cmd[:3] == ["python3", "-m", "sglang.launch_server"]
    assert option(cmd, "--model-path") == "/models/target"
    assert option(cmd, "--speculative-algorithm") == "EAGLE3"
    assert option(cmd, "--speculative-draft-model-path") == str(draft)
    assert (option(cmd, "--speculative-num-steps"), option(cmd, "--speculative-eagle-topk"),
            option(cmd, "--speculative-num-draft-tokens")) == ("5", "1", "6")
    assert option(cmd, "--cuda-graph-max-bs-decode") == "16"
    assert option(cmd, "--host") == "127.0.0.1"
    assert option(cmd, "--port") == "30000"
    assert option(cmd, "--tp") == "1"
    assert "--enable-metrics" in cmd
    # 0.5.23 rejects the old flag ("ambiguous option"); the quantization/remote-code flags are opt-in
    assert not {"--cuda-graph-max-bs", "--disable-cuda-graph", "--trust-remote-code", "--quantization",
                "--speculative-draft-model-quantization", "--context-length"} & set(cmd)


def test_command_keeps_the_draft_unquantized_under_a_quantized_target_and_passes_tp_and_context(tmp_path):
    draft = write_draft(tmp_path, max_position_embeddings=131072, vocab_size=128256, target_hidden_size=4096,
                        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 15, 28], "use_aux_hidden_state": True})
    cfg = pipeline_config(target={"quantization": "fp8", "tensor_parallel_size": 8, "context_length": 131072,
                                  "trust_remote_code": True},
                          serve={"host": "0.0.0.0", "port": 31000},
                          verify={"engine": "server"})     # a TP=8 target does not fit verify's one device
    cmd = serving.build_sglang_command(cfg, target_path="/m", draft_dir=draft, port=31555)
    assert option(cmd, "--quantization") == "fp8"
    assert option(cmd, "--speculative-draft-model-quantization") == "unquant"
    assert option(cmd, "--tp") == "8"
    assert option(cmd, "--context-length") == "131072"
    assert option(cmd, "--host") == "0.0.0.0"
    assert option(cmd, "--port") == "31555"
    assert "--trust-remote-code" in cmd


def test_command_without_cuda_graphs_uses_the_per_phase_backend_flags(tmp_path):
    cmd = serving.build_sglang_command(pipeline_config(), target_path="/m", draft_dir=write_draft(tmp_path),
                                     disable_cuda_graph=True)
    assert option(cmd, "--cuda-graph-backend-decode") == "disabled"
    assert option(cmd, "--cuda-graph-backend-prefill") == "disabled"
    assert "--cuda-graph-max-bs-decode" not in cmd and "--cuda-graph-max-bs" not in cmd


def test_command_refuses_a_draft_architecture_with_no_known_algorithm(tmp_path):
    draft = write_draft(tmp_path, architectures=["LlamaForCausalLM"])
    with pytest.raises(KeyError, match=r"architectures\[0\]='LlamaForCausalLM'.*LlamaForCausalLMEagle3"):
        serving.build_sglang_command(pipeline_config(), target_path="/m", draft_dir=draft)


# --- preflight ------------------------------------------------------------------------------------

def failed(findings: list[Finding]) -> dict[str, Finding]:
    """The failed findings by catalogue row (the first of each row)."""
    out: dict[str, Finding] = {}
    for f in findings:
        if f.status == "fail":
            out.setdefault(f.id, f)
    return out


def test_preflight_passes_the_command_we_build(tmp_path):
    draft = write_draft(tmp_path)
    cmd = serving.build_sglang_command(pipeline_config(), target_path="/m", draft_dir=draft)
    findings = serving.preflight(draft, cmd, target_config=TARGET, env={})
    assert {f.id: f.status for f in findings} == {"F1": "pass", "F7": "pass", "F5": "pass", "F4": "pass"}
    serving.assert_preflight(findings)


@pytest.mark.parametrize("typed", [["--speculative-algorithm", "EAGLE"], ["--speculative-algorithm=NEXTN"],
                                   ["--speculative-algo", "eagle"]])
def test_preflight_refuses_eagle_or_nextn_with_an_eagle3_draft(tmp_path, typed):
    draft = write_draft(tmp_path)
    cmd = ["python3", "-m", "sglang.launch_server", "--model-path", "/m", "--speculative-draft-model-path",
           str(draft), *typed]
    f1 = failed(serving.preflight(draft, cmd, target_config=TARGET, env={}))["F1"]
    assert "use EAGLE3" in f1.fix and "aux layers" in f1.fix and "fc" in f1.fix
    assert f1.where == str(draft / "config.json")
    with pytest.raises(serving.PreflightError, match="F1"):
        serving.assert_preflight(serving.preflight(draft, cmd, target_config=TARGET, env={}))


def test_preflight_refuses_a_missing_or_null_draft_vocab_size(tmp_path):
    for value in (..., None):
        draft = write_draft(tmp_path, draft_vocab_size=value)
        cmd = serving.build_sglang_command(pipeline_config(), target_path="/m", draft_dir=draft)
        f7 = failed(serving.preflight(draft, cmd, target_config=TARGET, env={}))["F7"]
        assert "config.json:draft_vocab_size" in f7.where and "missing or null" in f7.evidence
        assert "re-export" in f7.fix


def test_preflight_refuses_a_draft_declared_as_a_plain_llama(tmp_path):
    draft = write_draft(tmp_path, architectures=["LlamaForCausalLM"])
    cmd = ["sglang", "--speculative-algorithm", "EAGLE3"]
    f7 = failed(serving.preflight(draft, cmd, target_config=TARGET, env={}))["F7"]
    assert "config.json:architectures" in f7.where
    assert "['LlamaForCausalLMEagle3']" in f7.evidence and "got ['LlamaForCausalLM']" in f7.evidence
    # its eagle_config still marks it as an EAGLE-3 draft, so EAGLE is refused for it too
    assert "F1" in failed(serving.preflight(draft, ["--speculative-algorithm", "EAGLE"], target_config=TARGET, env={}))


def test_preflight_refuses_a_draft_built_for_another_target_vocab(tmp_path):
    draft = write_draft(tmp_path)
    cmd = serving.build_sglang_command(pipeline_config(), target_path="/m", draft_dir=draft)
    problems = failed(serving.preflight(draft, cmd, target_config={**TARGET, "vocab_size": 49152}, env={}))
    assert any("vocab_size" in f.evidence and "49152" in f.evidence for f in problems.values())


def test_preflight_refuses_a_draft_context_shorter_than_the_serving_context_and_names_three_fixes(tmp_path):
    draft = write_draft(tmp_path, max_position_embeddings=2048)
    cfg = pipeline_config(target={"context_length": 8192})
    cmd = serving.build_sglang_command(cfg, target_path="/m", draft_dir=draft)
    f5 = failed(serving.preflight(draft, cmd, target_config=TARGET, env={}))["F5"]
    assert "max_position_embeddings=2048 < serving context length 8192" in f5.evidence
    assert "re-export" in f5.fix and "--context-length" in f5.fix and LONGER_CONTEXT_ENV in f5.fix
    # the env override lets SGLang start, so it is a warning, not a refusal
    env = {LONGER_CONTEXT_ENV: "1"}
    statuses = {f.id: f.status for f in serving.preflight(draft, cmd, target_config=TARGET, env=env)}
    assert statuses["F5"] == "warn"


def test_preflight_takes_the_serving_context_from_the_target_when_no_flag_is_given(tmp_path):
    draft = write_draft(tmp_path, max_position_embeddings=1024)
    cmd = serving.build_sglang_command(pipeline_config(), target_path="/m", draft_dir=draft)
    assert "F5" in failed(serving.preflight(draft, cmd, target_config=TARGET, env={}))


def test_preflight_refuses_aux_layer_ids_the_target_cannot_capture(tmp_path):
    # SGLang id 3 = internal 4 = the output of the last of 4 layers: never captured
    draft = write_draft(tmp_path, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 3],
                                                "use_aux_hidden_state": True})
    cmd = serving.build_sglang_command(pipeline_config(), target_path="/m", draft_dir=draft)
    f4 = failed(serving.preflight(draft, cmd, target_config=TARGET, env={}))["F4"]
    assert "eagle_aux_hidden_state_layer_ids=[0, 1, 3]" in f4.evidence and "[4]" in f4.evidence


def test_preflight_refuses_aux_ids_a_deepseek_target_would_shift_differently(tmp_path):
    # internal [1, 2, 3] → SGLang [0, 1, 2]: deepseek_v2.py adds +1 only when the first id is 1
    draft = write_draft(tmp_path)
    cmd = serving.build_sglang_command(pipeline_config(), target_path="/m", draft_dir=draft)
    deepseek = {**TARGET, "architectures": ["DeepseekV3ForCausalLM"]}
    f4 = failed(serving.preflight(draft, cmd, target_config=deepseek, env={}))["F4"]
    assert "capture internal [0, 1, 2] instead of the trained [1, 2, 3]" in f4.evidence
    assert "internal 2" in f4.fix
    (tmp_path / "ok").mkdir()
    ok = write_draft(tmp_path / "ok", eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2],
                                                    "use_aux_hidden_state": True})
    assert "F4" not in failed(serving.preflight(ok, cmd, target_config=deepseek, env={}))


def test_preflight_refuses_aux_ids_only_at_the_top_level(tmp_path):
    draft = write_draft(tmp_path, eagle_config=..., eagle_aux_hidden_state_layer_ids=[1, 2, 3])
    cmd = serving.build_sglang_command(pipeline_config(), target_path="/m", draft_dir=draft)
    findings = serving.preflight(draft, cmd, target_config=TARGET, env={})
    assert any("eagle_config only" in f.evidence for f in findings if (f.id, f.status) == ("F4", "fail"))


def test_target_config_falls_back_to_the_declared_shape(tmp_path):
    cfg = pipeline_config(target={"source": "hf_dir", "path": "/gpu-host/moe", "num_hidden_layers": 61,
                                  "hidden_size": 7168, "context_length": 65536})
    assert serving.target_config_for(cfg.target, tmp_path / "absent") == {
        "num_hidden_layers": 61, "hidden_size": 7168, "max_position_embeddings": 65536}
    tiny = pipeline_config(target={"context_length": 4096})
    assert serving.target_config_for(tiny.target, tmp_path / "absent") == {
        "num_hidden_layers": 4, "hidden_size": 128, "vocab_size": 2048, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(TARGET))
    assert serving.target_config_for(cfg.target, tmp_path) == TARGET


# --- CLI ------------------------------------------------------------------------------------------

def test_cli_prints_the_exact_command(tmp_path, capsys):
    draft = write_draft(tmp_path)
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(TARGET))
    rc = serve.main(["--config", "tiny", "--draft", str(draft), "--target-path", str(tmp_path / "target"),
                     "--print-command", "--port", "31999"])
    out = capsys.readouterr().out.strip()
    assert rc == 0
    expected = serving.build_sglang_command(load_config(find_config("tiny")), target_path=str(tmp_path / "target"),
                                          draft_dir=str(draft), port=31999)
    assert shlex.split(out) == expected


def test_cli_exits_nonzero_with_the_findings_on_a_bad_draft(tmp_path, capsys):
    draft = write_draft(tmp_path, draft_vocab_size=None, max_position_embeddings=512)
    rc = serve.main(["--config", "tiny", "--draft", str(draft), "--target-path", str(tmp_path / "absent"),
                     "--print-command"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "[F7 FAIL]" in err and "draft_vocab_size" in err and "[F5 FAIL]" in err


def test_cli_names_an_unknown_draft_architecture(tmp_path, capsys):
    draft = write_draft(tmp_path, architectures=["Qwen2ForCausalLMEagle"])
    rc = serve.main(["--config", "tiny", "--draft", str(draft), "--target-path", "/m", "--print-command"])
    assert rc == 1
    assert "architectures[0]='Qwen2ForCausalLMEagle' has no known SGLang algorithm" in capsys.readouterr().err


# --- launch / health / deadline / retry / stop ----------------------------------------------------

@pytest.fixture
def fake_server() -> list[str]:
    return [sys.executable, str(FAKE_SERVER)]


def health(port: int) -> str:
    return f"http://127.0.0.1:{port}/health_generate"


def test_launch_waits_for_health_then_stop_ends_the_process_group(tmp_path, fake_server):
    port, child_pid_file = free_port(), tmp_path / "child.pid"
    cmd = [*fake_server, "--port", str(port), "--ready-after-s", "1.5", "--child-pid-file", str(child_pid_file)]
    started = time.monotonic()
    server = launching.launch(cmd, log_path=tmp_path / "log" / "server.log", health_url=health(port), timeout_s=20,
                          env={"EAGLENEST_TEST_MARK": "from-launch"})
    waited = time.monotonic() - started
    try:
        assert 1.5 <= waited < 10
        assert launching.health_status(health(port)) == 200
        child = int(child_pid_file.read_text())
        assert process_alive(child)
    finally:
        server.stop(grace_s=5)
    assert server.process.returncode is not None
    assert launching.health_status(health(port)) is None
    time.sleep(0.2)  # let init reap the child
    assert not process_alive(child), "stop() must end the server's children (SGLang scheduler processes)"
    # the server's output is in the log, and it saw the extra variable on top of our environment
    assert "mark: from-launch" in (tmp_path / "log" / "server.log").read_text()


def test_stop_kills_a_server_that_ignores_sigterm_after_the_grace_period(tmp_path, fake_server):
    port = free_port()
    cmd = [*fake_server, "--port", str(port), "--ignore-sigterm"]
    server = launching.launch(cmd, log_path=tmp_path / "s.log", health_url=health(port), timeout_s=20)
    started = time.monotonic()
    rc = server.stop(grace_s=1.0)
    assert rc == -9
    assert 1.0 <= time.monotonic() - started < 5


def test_launch_kills_the_server_at_the_deadline(tmp_path, fake_server):
    port = free_port()
    cmd = [*fake_server, "--port", str(port), "--hang-with-cuda-graphs"]
    started = time.monotonic()
    with pytest.raises(launching.ServerStartError, match=f"not healthy after {HANG_S} s"):
        launching.launch(cmd, log_path=tmp_path / "s.log", health_url=health(port), timeout_s=HANG_S)
    assert time.monotonic() - started < 10
    assert launching.health_status(health(port)) is None, "the hung server must be killed at the deadline"


def test_launch_reports_a_server_that_exits_during_startup(tmp_path, fake_server):
    port = free_port()
    with pytest.raises(launching.ServerStartError, match="exited with code 2"):
        launching.launch([*fake_server, "--port", str(port), "--exit-code", "2"], log_path=tmp_path / "s.log",
                     health_url=health(port), timeout_s=20)


def test_a_cuda_graph_hang_is_retried_once_without_cuda_graphs_and_both_attempts_are_recorded(tmp_path,
                                                                                               fake_server):
    port = free_port()
    cfg = pipeline_config()
    draft = write_draft(tmp_path)

    def command_for(disable: bool) -> list[str]:
        cmd = serving.build_sglang_command(cfg, target_path="/m", draft_dir=draft, port=port,
                                         disable_cuda_graph=disable, launcher=fake_server)
        return [*cmd, "--hang-with-cuda-graphs"]

    with launching.launch_with_fallback(command_for, log_dir=tmp_path / "logs", health_url=health(port),
                                    timeout_s=HANG_S) as server:
        assert launching.health_status(health(port)) == 200
        attempts = server.attempts
    assert [a["cuda_graph"] for a in attempts] == [True, False]
    assert attempts[0]["outcome"].startswith("failed:") and f"not healthy after {HANG_S} s" in attempts[0]["outcome"]
    assert attempts[1]["outcome"] == "healthy"
    assert attempts[0]["seconds"] >= HANG_S and attempts[1]["seconds"] < 5 * HANG_S
    assert "--cuda-graph-max-bs-decode" in attempts[0]["command"]
    assert "--cuda-graph-backend-decode disabled" in attempts[1]["command"]
    assert launching.health_status(health(port)) is None


def test_two_failed_attempts_raise_with_both_recorded(tmp_path, fake_server):
    port = free_port()
    with pytest.raises(launching.ServerStartError) as err:
        launching.launch_with_fallback(lambda disable: [*fake_server, "--port", str(port), "--exit-code", "3"],
                                   log_dir=tmp_path, health_url=health(port), timeout_s=10)
    assert [a["cuda_graph"] for a in err.value.attempts] == [True, False]
    assert all("exited with code 3" in a["outcome"] for a in err.value.attempts)
    assert (tmp_path / "server-attempt1.log").exists() and (tmp_path / "server-attempt2.log").exists()


def test_cli_takes_the_target_path_from_an_hf_dir_config(tmp_path, capsys):
    draft = write_draft(tmp_path, max_position_embeddings=131072, vocab_size=128256, target_hidden_size=4096,
                        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 15, 28], "use_aux_hidden_state": True})
    rc = serve.main(["--config", "llama-3.1-8b-instruct", "--draft", str(draft), "--print-command"])
    out = shlex.split(capsys.readouterr().out.strip())
    assert rc == 0, capsys.readouterr().err
    assert out[out.index("--model-path") + 1] == "/models/Meta-Llama-3.1-8B-Instruct"
    assert out[out.index("--speculative-algorithm") + 1] == "EAGLE3"


def test_cli_without_a_target_path_names_the_fix(tmp_path, capsys):
    rc = serve.main(["--config", "tiny", "--draft", str(write_draft(tmp_path)), "--print-command"])
    assert rc == 2 and "--target-path" in capsys.readouterr().err


def test_cli_finds_the_target_of_an_export_through_its_lineage(tmp_path, capsys):
    """`serve --draft <export>/sglang` (or the export id) on a config that names no model directory: the
    export's manifest in the store records its target, so no --target-path is needed; one still overrides."""
    from tests.builders import bigram_world

    world = bigram_world(tmp_path, free_port())
    store, export_id = world["store"], world["export_id"]
    for draft in (str(world["draft_dir"]), export_id):
        rc = serve.main(["--config", "tiny", "--store", store.uri, "--draft", draft, "--print-command"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        argv = shlex.split(out.strip())
        assert argv[argv.index("--model-path") + 1] == str(world["target_dir"])
        assert argv[argv.index("--speculative-draft-model-path") + 1] == str(world["draft_dir"])
    other = tmp_path / "elsewhere"
    shutil.copytree(world["target_dir"], other)
    rc = serve.main(["--config", "tiny", "--draft", str(world["draft_dir"]), "--target-path", str(other),
                     "--print-command"])
    argv = shlex.split(capsys.readouterr().out.strip())
    assert rc == 0 and argv[argv.index("--model-path") + 1] == str(other)
    # neither a directory nor an id: one line naming both forms
    assert serve.main(["--config", "tiny", "--draft", str(tmp_path / "nope"), "--print-command"]) == 2
    assert "neither a directory nor an export artifact id" in capsys.readouterr().err


def test_a_server_start_error_survives_pickling_with_its_attempts():
    """Prefect pickles a failed run's exception and the parent pipeline unpickles it."""
    import pickle

    err = launching.ServerStartError("never healthy", [{"outcome": "failed", "cuda_graph": True}])
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == "never healthy" and back.attempts == err.attempts


def test_the_printed_command_names_the_draft_and_target_by_absolute_path(tmp_path, capsys, monkeypatch):
    """Pasted into another shell (another working directory), the command still finds both directories."""
    from tests.builders import bigram_world

    world = bigram_world(tmp_path, free_port())
    monkeypatch.chdir(tmp_path)
    draft = os.path.relpath(world["draft_dir"], tmp_path)
    target = os.path.relpath(world["target_dir"], tmp_path)
    assert not Path(draft).is_absolute() and Path(draft).is_dir()
    rc = serve.main(["--config", "tiny", "--draft", draft, "--target-path", target, "--print-command"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    argv = shlex.split(out.strip())
    assert argv[argv.index("--speculative-draft-model-path") + 1] == str(world["draft_dir"])
    assert argv[argv.index("--model-path") + 1] == str(world["target_dir"])


def test_from_any_directory_the_default_config_and_a_printed_file_uri_serve(tmp_path):
    """`eaglenest serve --draft file:///…/sglang --print-command` typed in another folder: the default config
    (configs/tiny.yaml) is the shipped one, and the draft's `file://` URI as a run printed it is its directory."""
    from tests.builders import bigram_world

    world = bigram_world(tmp_path, free_port())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "flows.cli", "serve", "--draft", f"file://{world['draft_dir']}",
                          "--print-command"], cwd=elsewhere, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(repo)})
    assert out.returncode == 0, out.stderr
    argv = shlex.split(out.stdout.strip())
    assert argv[argv.index("--speculative-draft-model-path") + 1] == str(world["draft_dir"])
    assert argv[argv.index("--model-path") + 1] == str(world["target_dir"])


def test_a_taken_serve_port_falls_back_to_a_free_one(caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        chosen = launching.available_port("127.0.0.1", port)
        assert chosen != port and chosen > 0
        assert f"port {port} on 127.0.0.1 is taken; serving on {chosen}" in caplog.text
        with socket.socket() as probe:       # the one it picked can be bound: nothing listens there
            probe.bind(("127.0.0.1", chosen))
    free = free_port()
    assert launching.available_port("127.0.0.1", free) == free
