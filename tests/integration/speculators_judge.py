"""speculators 0.9.0's own config and model classes, on a CPU, as the judge of our vLLM export and forward.

Runs inside `.venv-speculators` (scripts/setup-speculators-venv.sh), never in the main venv; imports no
eaglenest code (only benchmarks/stand_ins.py, standard library: empty `openai` / `datasets` modules that
speculators imports at module level and its EAGLE-3 model never calls). tests/integration/
test_speculators_forward.py calls it once:

    .venv-speculators/bin/python tests/integration/speculators_judge.py < request.json > verdict.json

stdin: `{"draft", "inputs", "out", "ttt_steps"}`: a vLLM (speculators-format) draft directory, a safetensors
file with `input_ids`, `hidden_states`, `position_ids`, `document_ids` ([1, L], [1, L, A*H]: speculators'
training layout, token x[p+1] beside the aux states of p), where to write `logits_<j>` per TTT step, and
`save`, where the loaded model is written back by its own `save_pretrained` (the input `eaglenest convert`
reads for a draft trained by speculators).

1. loading: speculators' `Eagle3SpeculatorConfig.from_pretrained` and `Eagle3DraftModel.from_pretrained`
   (its own override, which resolves the aux layer ids against the verifier); then every
   parameter and buffer is compared with the checkpoint tensor of the same name. Before loading, the model
   class's own initialisation is replaced by a sentinel fill (NaN, or the integer minimum), so a parameter
   no checkpoint key filled is still NaN afterwards, whatever its name (`left_sentinel`);
2. forward: the model's own `forward` (the TTT unroll speculators trains with, `ttt_steps` steps, teacher
   forcing) with `sdpa` attention (flex attention needs a GPU compile); each step's logits are read off
   `lm_head` by a forward hook (the forward returns only argmax tokens without a loss).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # benchmarks/stand_ins.py, run as a script
from benchmarks.stand_ins import stand_in  # noqa: E402

stand_in()


import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: E402

#: parameters speculators computes from the verifier, never saved (`_keys_to_ignore_on_save`)
VERIFIER_ONLY = ("verifier_norm.weight", "verifier_lm_head.weight")


def sentinel_init(module: torch.nn.Module) -> None:
    """Parameters and saved buffers of `module` (not its computed ones, e.g. rotary `inv_freq`)."""
    saved = [b for n, b in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set]
    for t in [*module.parameters(recurse=False), *saved]:
        if t.dtype.is_floating_point:
            t.data.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.data.fill_(torch.iinfo(t.dtype).min)


def is_sentinel(t: torch.Tensor) -> bool:
    if t.dtype.is_floating_point:
        return bool(torch.isnan(t).all())
    return t.dtype != torch.bool and bool((t == torch.iinfo(t.dtype).min).all())


def load(path: str) -> tuple[Eagle3DraftModel, dict[str, Any]]:
    config = Eagle3SpeculatorConfig.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "sdpa"
    # the model's own weight initialisation, replaced by the sentinel (transformers calls it for every
    # module whose weights the checkpoint does not hold)
    own_init = Eagle3DraftModel._init_weights

    def init_then_sentinel(self, module):
        own_init(self, module)
        sentinel_init(module)

    Eagle3DraftModel._init_weights = init_then_sentinel
    model = Eagle3DraftModel.from_pretrained(path, config=config, torch_dtype=torch.float32)
    file = load_file(str(Path(path) / "model.safetensors"))
    state = model.state_dict()
    return model.eval(), {
        "model_class": type(model).__name__,
        "config_class": type(model.config).__name__,
        "parameters": sorted(state),
        "file_keys": sorted(file),
        "not_in_file": sorted(set(state) - set(file)),
        "ignored_file_keys": sorted(set(file) - set(state)),
        "values_differ": sorted(k for k in set(state) & set(file)
                                if not torch.equal(state[k].to(file[k].dtype), file[k])),
        "left_sentinel": sorted(k for k, t in state.items() if is_sentinel(t)),
    }


def forward(model: Eagle3DraftModel, inputs: dict[str, torch.Tensor], ttt_steps: int) -> dict[str, torch.Tensor]:
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out.detach().clone()))
    try:
        with torch.no_grad():
            model(hidden_states=inputs["hidden_states"], input_ids=inputs["input_ids"],
                  document_ids=inputs["document_ids"], position_ids=inputs["position_ids"], ttt_steps=ttt_steps)
    finally:
        hook.remove()
    return {f"logits_{j}": t[0].contiguous() for j, t in enumerate(logits)}


def main() -> int:
    request = json.load(sys.stdin)
    with contextlib.redirect_stdout(sys.stderr):
        try:
            model, verdict = load(request["draft"])
            verdict["version"] = importlib.metadata.version("speculators")
            save_file(forward(model, load_file(request["inputs"]), int(request["ttt_steps"])), request["out"])
            model.save_pretrained(request["save"])        # speculators' own writer: what `convert` reads
        except Exception as exc:
            verdict = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}
    print(json.dumps(verdict, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
