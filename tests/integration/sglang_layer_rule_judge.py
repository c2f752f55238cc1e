"""SGLang 0.5.23's own `set_eagle3_layers_to_capture`, per target architecture, as the judge of F4's rules.

Runs inside `.venv-sglang` (it imports sglang; `sglang_judge` supplies the stand-ins for what a CPU
cannot import). tests/integration/test_sglang_layer_rules.py calls it once:

    .venv-sglang/bin/python tests/integration/sglang_layer_rule_judge.py < cases.json

stdin: `{"cases": [{"arch", "ids", "num_layers"}]}` (`ids`: what a draft's eagle_config holds).
stdout, last line: `{"version", "captured": [layers_to_capture per case]}`. The method is called unbound on
a stand-in `self` holding only what it reads (`pp_group.is_last_rank`, `config.num_hidden_layers`) and
where it writes (`model.layers_to_capture`): the rule is SGLang's code, not a copy of it. Kimi-K2.5's
wrapper delegates to its DeepSeek-V3 `language_model`, which the stand-in holds as SGLang builds it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
with contextlib.redirect_stdout(sys.stderr):
    import sglang_judge  # noqa: E402  (first: stand-ins for sgl_kernel / torchvision, SGLang's CPU mode)

sglang = sglang_judge.sglang

#: architecture → (sglang.srt.models module, class); the wrapper's inner model where it delegates.
CLASSES = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("deepseek_v2", "DeepseekV32ForCausalLM"),
    "Glm4MoeLiteForCausalLM": ("glm4_moe_lite", "Glm4MoeLiteForCausalLM"),
    "KimiK25ForConditionalGeneration": ("kimi_k25", "KimiK25ForConditionalGeneration"),
}
INNER = {"KimiK25ForConditionalGeneration": "DeepseekV3ForCausalLM"}


def model_class(arch: str) -> type:
    module, name = CLASSES[arch]
    return getattr(importlib.import_module(f"sglang.srt.models.{module}"), name)


def stand_in(arch: str, num_layers: int) -> tuple[types.SimpleNamespace, types.SimpleNamespace]:
    """(self for arch's method, the namespace whose `model.layers_to_capture` the rule sets)."""
    me = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True), model=types.SimpleNamespace(),
                               config=types.SimpleNamespace(num_hidden_layers=num_layers))
    if arch not in INNER:
        return me, me
    inner, _ = stand_in(INNER[arch], num_layers)
    inner.set_eagle3_layers_to_capture = functools.partial(model_class(INNER[arch]).set_eagle3_layers_to_capture,
                                                           inner)
    return types.SimpleNamespace(language_model=inner), inner


def captured(arch: str, ids: list[int], num_layers: int) -> list[int]:
    me, holder = stand_in(arch, num_layers)
    with contextlib.redirect_stdout(sys.stderr):
        model_class(arch).set_eagle3_layers_to_capture(me, ids)
    return list(holder.model.layers_to_capture)


def main() -> int:
    cases = json.load(sys.stdin)["cases"]
    out = {"version": sglang.__version__, "captured": [captured(c["arch"], c["ids"], c["num_layers"]) for c in cases]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
