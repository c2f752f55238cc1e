"""SGLang 0.5.23's own classes, on a CPU, as the judge of `extract.backend: sglang_runner`'s CPU parts.

Runs inside `.venv-sglang` with eaglenest on PYTHONPATH (steps/lib/extraction/sglang_runner.py imports no
SGLang itself). tests/integration/test_sglang_runner.py calls it once:

    .venv-sglang/bin/python tests/integration/sglang_runner_judge.py < request.json

stdin: `{"capture": [{"name", "target", "layer_ids", "full_build"}], "rows": {"dir", "sequences", "layer_ids",
"hidden_size", "storage_dtype"}}`. stdout, last line:
`{"version", "capture": {name: verdict}, "rows": verdict, "check_available"}` (`check_available`: the
backend's refusal on this GPU-less machine).

- capture: `runner_server_args(target, layer_ids)` (with `device="cpu"`) become SGLang's `ServerArgs`, are
  published and resolved by SGLang; the verdict has the resolved fields, the eagle ids ModelRunner's
  `resolve_spec_aux_hidden_state_config` derives, and the layers the target's own model class then
  captures (`set_eagle3_layers_to_capture`: the real class built by sglang_judge for `full_build`, the
  class's method on a stand-in `self` otherwise, as sglang_layer_rule_judge does for DeepSeek).
- rows: `SGLangRunnerBackend` over an engine whose forward returns the `LogitsProcessorOutput` SGLang's
  `LogitsProcessor` builds for full capture — its own `_get_hidden_states_to_store` (aux packed by
  `pack_aux_hidden_states` from the per-layer list a model collects) and `_get_last_hidden_states_to_store`
  (the post-norm final state kept for in-process callers), SGLang's `CaptureHiddenMode` — written to a shard
  by `steps.extract.extract_shard`. Row (token t at position p of its sequence): aux layer k column j =
  (t % 64) + k + j/4, final column j = p + j/4 (exact in bf16). Negative controls: aux capture off
  (`keep_last_hidden_states` False), last-token capture (`CaptureHiddenMode.LAST`).
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
with contextlib.redirect_stdout(sys.stderr):
    import sglang_judge  # noqa: E402  (first: stand-ins for sgl_kernel / torchvision, SGLang's CPU mode)
    import sglang_layer_rule_judge  # noqa: E402

import torch  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode  # noqa: E402
from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (  # noqa: E402
    resolve_spec_aux_hidden_state_config,
)
from sglang.srt.runtime_context import SpawnRanks, get_model, get_spec, publish  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from steps import extract  # noqa: E402
from steps.lib.extraction import sglang_runner  # noqa: E402

RESOLVED = ["aux_hidden_state_capture", "speculative_algorithm", "enable_return_aux_hidden_states",
            "return_aux_hidden_state_layer_ids", "disable_radix_cache", "chunked_prefill_size", "disable_cuda_graph",
            "tp_size", "context_length", "mem_fraction_static", "speculative_draft_model_path"]


def judge_capture(case: dict[str, Any]) -> dict[str, Any]:
    arch = json.loads((Path(case["target"]) / "config.json").read_text())["architectures"][0]
    fields = sglang_runner.runner_server_args(case["target"], case["layer_ids"], arch=arch, tp_size=1,
                                              mem_fraction=0.5, context_length=64)
    args = ServerArgs(**fields, device="cpu")
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    resolved = args.resolved_dict()
    model_config = ModelConfig.from_server_args(args, model_path=get_model().model_path,
                                                model_revision=get_model().revision, is_draft_model=False)
    aux = resolve_spec_aux_hidden_state_config(
        server_args=args, model_config=model_config,
        spec_algorithm=SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm), is_draft_worker=False)
    num_layers = int(model_config.hf_text_config.num_hidden_layers)
    verdict = {"arch": arch, "server_args": fields, "resolved": {f: resolved.get(f) for f in RESOLVED},
               "eagle_use_aux_hidden_state": aux.eagle_use_aux_hidden_state,
               "eagle_aux_hidden_state_layer_ids": aux.eagle_aux_hidden_state_layer_ids,
               "captured": sglang_layer_rule_judge.captured(arch, list(aux.eagle_aux_hidden_state_layer_ids),
                                                            num_layers)}
    if case.get("full_build"):
        verdict["built"] = sglang_judge.capture(args)
    return verdict


def row_values(seqs: list[list[int]], num_aux: int, hidden: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(the per-layer aux list a model collects, the post-norm final rows), rows in request order."""
    t = torch.tensor([tok for s in seqs for tok in s], dtype=torch.float32)
    p = torch.tensor([i for s in seqs for i in range(len(s))], dtype=torch.float32)
    j = torch.arange(hidden, dtype=torch.float32) / 4
    aux = [((t % 64) + k)[:, None] + j[None, :] for k in range(num_aux)]
    return aux, p[:, None] + j[None, :]


class SGLangOutputs:
    """An engine whose forward returns what SGLang's LogitsProcessor returns for this capture."""

    def __init__(self, num_aux: int, hidden: int, *, keep_last: bool = True, mode: CaptureHiddenMode = None):
        self.num_aux, self.hidden, self.device = num_aux, hidden, "cpu"
        self.processor = types.SimpleNamespace(keep_last_hidden_states=keep_last)
        self.metadata = types.SimpleNamespace(capture_hidden_mode=mode or CaptureHiddenMode.FULL)

    def forward(self, batch: list[list[int]]) -> LogitsProcessorOutput:
        aux, final = row_values(batch, self.num_aux, self.hidden)
        last = torch.tensor([sum(map(len, batch[:i + 1])) - 1 for i in range(len(batch))])
        stored = LogitsProcessor._get_hidden_states_to_store(
            self.processor, final, None, aux, final[last], None, [a[last] for a in aux], None, self.metadata)
        kept = LogitsProcessor._get_last_hidden_states_to_store(self.processor, final, aux, self.metadata)
        return LogitsProcessorOutput(next_token_logits=torch.zeros(len(batch), 8), hidden_states=stored,
                                     last_hidden_states=kept)


def judge_rows(req: dict[str, Any]) -> dict[str, Any]:
    seqs, layer_ids, hidden = req["sequences"], req["layer_ids"], req["hidden_size"]
    fmt = extract.ShardFormat(tuple(layer_ids), hidden, req["storage_dtype"])
    plan = extract.plan_shards([len(s) for s in seqs], 10_000, fmt)[0]
    sequences = [{"input_ids": s, "loss_mask": [1] * len(s)} for s in seqs]
    path = Path(req["dir"]) / "shard.safetensors"
    backend = sglang_runner.SGLangRunnerBackend(SGLangOutputs(len(layer_ids), hidden), layer_ids, hidden_size=hidden)
    extract.extract_shard(backend, plan, sequences, path, batch_size=2, fmt=fmt)
    verdict: dict[str, Any] = {"shard": str(path), "refused": {}}
    for name, engine in {"aux_capture_off": SGLangOutputs(len(layer_ids), hidden, keep_last=False),
                         "last_token_capture": SGLangOutputs(len(layer_ids), hidden, mode=CaptureHiddenMode.LAST)
                         }.items():
        try:
            sglang_runner.SGLangRunnerBackend(engine, layer_ids, hidden_size=hidden).capture(seqs[:2])
            verdict["refused"][name] = None
        except ValueError as exc:
            verdict["refused"][name] = str(exc)
    return verdict


def main() -> int:
    request = json.load(sys.stdin)
    out: dict[str, Any] = {"version": sglang_judge.sglang.__version__, "capture": {}}
    with contextlib.redirect_stdout(sys.stderr):       # SGLang prints; stdout carries only the verdict
        first = request["capture"][0]
        publish(ServerArgs(model_path=first["target"], device="cpu"), role="scheduler",
                ranks=SpawnRanks(world_rank=0))
        sglang_judge.init_distributed()
        for case in request["capture"]:
            try:
                out["capture"][case["name"]] = judge_capture(case)
            except Exception as exc:
                out["capture"][case["name"]] = {"error": sglang_judge.error(exc),
                                                "traceback": traceback.format_exc()[-3000:]}
        try:                                            # SGLang is here, CUDA is not: the second line
            sglang_runner.check_available()
            out["check_available"] = None
        except Exception as exc:
            out["check_available"] = str(exc)
        try:
            out["rows"] = judge_rows(request["rows"])
        except Exception as exc:
            out["rows"] = {"error": sglang_judge.error(exc), "traceback": traceback.format_exc()[-3000:]}
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
