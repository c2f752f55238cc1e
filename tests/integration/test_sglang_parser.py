"""SGLang 0.5.23's own parser is the judge of the launch commands steps/serve.py builds.

For each shipped config, the command built from an exported draft config.json (written by the
export's own builders) and a target config.json is parsed by `ServerArgs.add_cli_args`, turned into
`ServerArgs.from_cli_args`, and run through `resolve_once()` + `check_server_args()` on a CPU (the
targets are config.json-only directories: resolution reads configs, never weights). It must resolve
to EAGLE3 with our steps / topk / draft tokens / CUDA-graph batch size. Negative controls: the old
`--cuda-graph-max-bs` is rejected by the same parser; `EAGLE` with an EAGLE-3 draft passes it (so only
our preflight stops F1); without `--speculative-draft-model-quantization unquant` the draft of the
fp8 MoE target resolves to fp8.

SGLang runs in its own venv, `.venv-sglang` (scripts/setup-sglang-venv.sh): its dependencies
conflict with ours (transformers 5.19, triton). A missing venv FAILS this test, never skips it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from steps import export, train
from steps.lib.config import PipelineConfig, load_config, resolve_aux_layer_ids, resolve_max_position_embeddings
from steps.lib.extraction import capture
from steps.lib.serving import start as serving

ROOT = Path(__file__).resolve().parents[2]
#: the judge's interpreter; EAGLENEST_SGLANG_PYTHON points at another SGLang 0.5.23 install.
SGLANG_PYTHON = Path(os.environ.get("EAGLENEST_SGLANG_PYTHON", ROOT / ".venv-sglang" / "bin" / "python"))
CONFIGS = ["tiny", "smollm2-135m", "llama-3.1-8b-instruct", "moe-7168"]
#: resolving on a CPU needs `--device cpu`; the GPU commands we ship leave the device to SGLang.
CPU_ONLY_ARGS = ["--device", "cpu"]

# Target config.json files as their checkpoints ship them (only the fields SGLang reads to resolve).
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
         "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
TARGET_CONFIGS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {**LLAMA, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0, "tie_word_embeddings": True},
    "llama-3.1-8b-instruct": {
        **LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}},
    "moe-7168": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 64, "num_key_value_heads": 64, "vocab_size": 163840,
        "max_position_embeddings": 131072, "rope_theta": 50000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "norm_topk_prob": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]}},
}

# Runs inside .venv-sglang. Reads [{name, argv, resolve}] on stdin, prints {name: verdict} as JSON.
JUDGE = r'''
import argparse, contextlib, importlib.abc, importlib.machinery, io, json, sys, types
from unittest import mock

# sglang.srt.configs imports torchvision (an InternVL helper) on the resolve path; it is not needed
# to resolve a Llama/DeepSeek config and would pull a CUDA torch, so it is stubbed here
# (shared/reference/offline-assets.md §4). transformers must first record "torchvision: absent".
import transformers.utils.import_utils  # noqa: F401

class _Stub(types.ModuleType):
    __path__ = []
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = mock.MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value

class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None
    def create_module(self, spec):
        return _Stub(spec.name)
    def exec_module(self, module):
        pass

sys.meta_path.insert(0, _StubFinder())

import sglang
from sglang.srt.server_args import ServerArgs

FIELDS = ["speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
          "speculative_eagle_topk", "speculative_num_draft_tokens", "speculative_draft_model_quantization",
          "quantization", "tp_size", "context_length", "host", "port", "enable_metrics", "trust_remote_code",
          "cuda_graph_max_bs_decode", "cuda_graph_backend_decode", "cuda_graph_backend_prefill",
          "enable_return_aux_hidden_states", "return_aux_hidden_state_layer_ids", "enable_return_hidden_states",
          "disable_radix_cache", "aux_hidden_state_capture"]
request = json.load(sys.stdin)
parser = argparse.ArgumentParser(prog="sglang.launch_server")
ServerArgs.add_cli_args(parser)
options = [o for action in parser._actions for o in action.option_strings]
out = {"version": sglang.__version__,
       "prefixes": {p: [o for o in options if o.startswith(p)] for p in request["prefixes"]}, "cases": {}}
for case in request["cases"]:
    verdict = out["cases"][case["name"]] = {}
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(case["argv"])
    except SystemExit as exc:
        verdict.update(parse="rejected", exit_code=exc.code, stderr=err.getvalue()[-2000:])
        continue
    args = ServerArgs.from_cli_args(ns)
    verdict.update(parse="ok", parsed={f: getattr(args, f, None) for f in FIELDS})
    if case["resolve"]:
        try:
            args.resolve_once()
            args.check_server_args()
        except Exception as exc:
            verdict["resolve_error"] = f"{type(exc).__name__}: {exc}"
            continue
        resolved = args.resolved_dict()
        verdict["resolved"] = {f: resolved.get(f) for f in FIELDS + ["max_running_requests"]}
        verdict["resolved"]["decode_graph"] = resolved["cuda_graph_config"]["decode"]
print(json.dumps(out, default=str))
'''


# --- building what our export and serve steps would produce -----------------------------------------------

def target_config(name: str, cfg: PipelineConfig) -> dict[str, Any]:
    if name == "tiny":
        t = cfg.target.tiny
        return {**LLAMA, "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
                "num_hidden_layers": t.num_hidden_layers, "num_attention_heads": t.num_attention_heads,
                "num_key_value_heads": t.num_key_value_heads, "vocab_size": t.vocab_size,
                "max_position_embeddings": t.max_position_embeddings, "rope_theta": 10000.0,
                "torch_dtype": "float32"}
    return TARGET_CONFIGS[name]


def exported_sglang_config(cfg: PipelineConfig, tcfg: dict[str, Any]) -> dict[str, Any]:
    """The SGLang draft config.json the export step writes for this config and target."""
    layer_ids = resolve_aux_layer_ids(cfg, int(tcfg["num_hidden_layers"]))
    d2t = torch.zeros(cfg.mapping.draft_vocab_size, dtype=torch.int64)
    draft_fields = dataclasses.asdict(train.draft_config(cfg, tcfg, len(layer_ids), d2t))
    return export.engine_config("sglang", draft_fields, layer_ids=layer_ids,
                                max_pos=resolve_max_position_embeddings(cfg, tcfg), cfg=cfg, target_config=tcfg)


def write_json_dir(path: Path, config: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def sglang_argv(cmd: list[str]) -> list[str]:
    """The arguments `python -m sglang.launch_server` hands to its parser."""
    assert cmd[:3] == list(serving.SGLANG_LAUNCHER), cmd[:3]
    return cmd[3:]


def replace_option(argv: list[str], flag: str, value: str) -> list[str]:
    i = argv.index(flag)
    return [*argv[:i + 1], value, *argv[i + 2:]]


@dataclasses.dataclass
class Served:
    cfg: PipelineConfig
    target_dir: Path
    draft_dir: Path
    cmd: list[str]


def prepare(name: str, root: Path) -> Served:
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    tcfg = target_config(name, cfg)
    target_dir = write_json_dir(root / name / "target", tcfg)
    draft_dir = write_json_dir(root / name / "sglang", exported_sglang_config(cfg, tcfg))
    cmd = serving.build_sglang_command(cfg, target_path=target_dir, draft_dir=draft_dir)
    return Served(cfg, target_dir, draft_dir, cmd)


def run_judge(cases: list[dict[str, Any]], prefixes: list[str]) -> dict[str, Any]:
    if not SGLANG_PYTHON.exists():
        pytest.fail(f"{SGLANG_PYTHON} is missing: run scripts/setup-sglang-venv.sh first (9-12 minutes on a busy "
                    "2-core machine, 2.5 GB; `make test` does it). SGLang's own parser judges our launch commands "
                    "here.")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": ""}
    proc = subprocess.run([str(SGLANG_PYTHON), "-c", JUDGE], input=json.dumps({"cases": cases, "prefixes": prefixes}),
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, f"the SGLang judge crashed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict[str, Served]:
    root = tmp_path_factory.mktemp("sglang-parser")
    return {name: prepare(name, root) for name in CONFIGS}


@pytest.fixture(scope="module")
def verdict(served) -> dict[str, Any]:
    tiny = sglang_argv(served["tiny"].cmd)
    cases = [{"name": name, "argv": sglang_argv(s.cmd) + CPU_ONLY_ARGS, "resolve": True}
             for name, s in served.items()]
    moe = sglang_argv(served["moe-7168"].cmd)
    i = moe.index("--speculative-draft-model-quantization")
    no_graphs = serving.build_sglang_command(served["tiny"].cfg, target_path=served["tiny"].target_dir,
                                           draft_dir=served["tiny"].draft_dir, disable_cuda_graph=True)
    cases += [
        {"name": "tiny-no-cuda-graph", "argv": sglang_argv(no_graphs) + CPU_ONLY_ARGS, "resolve": True},
        {"name": "old-max-bs-flag", "argv": [*tiny, "--cuda-graph-max-bs", "32"], "resolve": False},
        {"name": "moe-without-unquant", "argv": [*moe[:i], *moe[i + 2:], *CPU_ONLY_ARGS], "resolve": True},
        {"name": "eagle-with-eagle3-draft",
         "argv": replace_option(tiny, "--speculative-algorithm", "EAGLE") + CPU_ONLY_ARGS, "resolve": True},
    ]
    # extraction's two servers of the tiny target, with the flags steps/lib/extraction/capture.py documents
    target = ["--model-path", str(served["tiny"].target_dir)]
    aux = capture.aux_server_args(extraction_layer_ids(served["tiny"]))
    without_algorithm = [a for a in aux if a not in ("--speculative-algorithm", "EAGLE3")]
    cases += [
        {"name": "extract-aux", "argv": [*target, *aux, *CPU_ONLY_ARGS], "resolve": True},
        {"name": "extract-final", "argv": [*target, *capture.FINAL_SERVER_ARGS, *CPU_ONLY_ARGS], "resolve": True},
        {"name": "extract-aux-without-algorithm", "argv": [*target, *without_algorithm, *CPU_ONLY_ARGS],
         "resolve": True},
    ]
    prefixes = [shortest for _, shortest in serving.WATCHED_FLAGS.values()]
    return run_judge(cases, prefixes)


def extraction_layer_ids(s: Served) -> list[int]:
    return resolve_aux_layer_ids(s.cfg, s.cfg.target.tiny.num_hidden_layers)


# --- the verdicts --------------------------------------------------------------------------------------------

def test_the_judge_is_sglang_0_5_23(verdict):
    assert verdict["version"] == "0.5.23"


@pytest.mark.parametrize("name", CONFIGS)
def test_sglang_parses_our_command_as_configured(verdict, served, name):
    v, s = verdict["cases"][name], served[name]
    assert v["parse"] == "ok", v.get("stderr")
    p = v["parsed"]
    assert p["speculative_algorithm"] == "EAGLE3"
    assert p["speculative_draft_model_path"] == str(s.draft_dir)
    assert (p["speculative_num_steps"], p["speculative_eagle_topk"], p["speculative_num_draft_tokens"]) == (
        s.cfg.serve.num_steps, s.cfg.serve.eagle_topk, s.cfg.serve.num_draft_tokens)
    assert p["cuda_graph_max_bs_decode"] == s.cfg.serve.cuda_graph_max_bs
    assert p["tp_size"] == s.cfg.target.tensor_parallel_size
    assert p["context_length"] == s.cfg.target.context_length
    assert (p["host"], p["port"], p["enable_metrics"]) == ("127.0.0.1", s.cfg.serve.port, True)
    if s.cfg.target.quantization:
        assert (p["quantization"], p["speculative_draft_model_quantization"]) == (s.cfg.target.quantization,
                                                                                  "unquant")
    else:
        assert p["speculative_draft_model_quantization"] is None


@pytest.mark.parametrize("name", CONFIGS)
def test_sglang_resolves_our_command_to_eagle3_with_our_speculative_settings(verdict, served, name):
    v, s = verdict["cases"][name], served[name]
    assert "resolve_error" not in v, v.get("resolve_error")
    r = v["resolved"]
    assert r["speculative_algorithm"] == "EAGLE3"
    assert (r["speculative_num_steps"], r["speculative_eagle_topk"], r["speculative_num_draft_tokens"]) == (
        s.cfg.serve.num_steps, s.cfg.serve.eagle_topk, s.cfg.serve.num_draft_tokens)
    assert r["decode_graph"]["backend"] == "full"
    # the explicit flag survives resolution; the graph's own max_bs does not on a CPU, where SGLang
    # sizes its CPU graphs by --torch-compile-max-bs (default 32) instead
    assert r["cuda_graph_max_bs_decode"] == s.cfg.serve.cuda_graph_max_bs


def test_our_draft_stays_unquantized_under_the_fp8_target_and_would_not_without_the_flag(verdict):
    ours, without = verdict["cases"]["moe-7168"]["resolved"], verdict["cases"]["moe-without-unquant"]["resolved"]
    assert ours["quantization"] == "fp8" and ours["speculative_draft_model_quantization"] is None
    # negative control: left unset, SGLang quantizes the bf16 draft like the target
    assert without["speculative_draft_model_quantization"] == "fp8"


def test_our_no_cuda_graph_command_resolves_to_disabled_decode_graphs(verdict):
    v = verdict["cases"]["tiny-no-cuda-graph"]
    assert "resolve_error" not in v, v.get("resolve_error")
    assert v["resolved"]["decode_graph"]["backend"] == "disabled"
    assert v["resolved"]["cuda_graph_backend_prefill"] == "disabled"


def test_sglang_rejects_the_old_cuda_graph_max_bs_flag(verdict):
    v = verdict["cases"]["old-max-bs-flag"]
    assert v["parse"] == "rejected" and v["exit_code"] == 2
    assert "ambiguous option: --cuda-graph-max-bs" in v["stderr"]


def test_sglang_accepts_eagle_for_an_eagle3_draft_so_only_our_preflight_stops_f1(verdict, served):
    v = verdict["cases"]["eagle-with-eagle3-draft"]
    assert v["parse"] == "ok"
    assert "resolve_error" not in v, v.get("resolve_error")
    assert v["resolved"]["speculative_algorithm"] == "EAGLE"
    s = served["tiny"]
    argv = replace_option(s.cmd, "--speculative-algorithm", "EAGLE")
    findings = serving.preflight(s.draft_dir, argv, target_config=target_config("tiny", s.cfg), env={})
    assert [f.id for f in findings if f.status == "fail"] == ["F1"]


@pytest.mark.parametrize("name", CONFIGS)
def test_our_preflight_passes_what_sglang_accepts(served, name):
    s = served[name]
    findings = serving.preflight(s.draft_dir, s.cmd, target_config=target_config(name, s.cfg), env={})
    assert [str(f) for f in findings if f.status == "fail"] == []


def test_sglang_resolves_extractions_aux_server_to_capture_without_a_draft(verdict, served):
    v = verdict["cases"]["extract-aux"]
    assert v["parse"] == "ok", v.get("stderr")
    assert "resolve_error" not in v, v.get("resolve_error")
    r = v["resolved"]
    # EAGLE3 names the capture convention only: no speculative stack, SGLang's ids (internal − 1)
    assert r["speculative_algorithm"] is None and r["aux_hidden_state_capture"] == "eagle3"
    assert r["enable_return_aux_hidden_states"] and r["disable_radix_cache"]
    assert r["return_aux_hidden_state_layer_ids"] == [i - 1 for i in extraction_layer_ids(served["tiny"])]


def test_sglang_resolves_extractions_final_server_to_final_hidden_states(verdict):
    v = verdict["cases"]["extract-final"]
    assert "resolve_error" not in v, v.get("resolve_error")
    r = v["resolved"]
    assert r["enable_return_hidden_states"] and not r["enable_return_aux_hidden_states"]
    assert r["disable_radix_cache"] and r["speculative_algorithm"] is None


def test_sglang_refuses_aux_capture_without_the_algorithm_that_names_its_convention(verdict):
    v = verdict["cases"]["extract-aux-without-algorithm"]
    assert "--enable-return-aux-hidden-states needs --speculative-algorithm" in v["resolve_error"]


def test_the_flag_prefixes_our_preflight_reads_are_unambiguous_in_sglang(verdict):
    for full, shortest in serving.WATCHED_FLAGS.values():
        assert verdict["prefixes"][shortest] == [full], (shortest, verdict["prefixes"][shortest])


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))
