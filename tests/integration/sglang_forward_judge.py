"""SGLang 0.5.23's own `LlamaForCausalLMEagle3` forward on a CPU: the judge of our draft's forward pass.

Runs inside `.venv-sglang` (like tests/integration/sglang_judge.py, whose stand-ins, server-args
publication, model construction and loader it reuses). tests/integration/test_sglang_forward.py calls it:

    .venv-sglang/bin/python tests/integration/sglang_forward_judge.py < request.json > verdict.json

stdin: `{"draft", "target", "inputs", "out"}`: an SGLang draft directory, the target's HF directory, a
safetensors file with `input_ids` [S], `positions` [S] and `hidden_states` [S, A*H] (the aux states, as
SGLang's EAGLE-3 worker hands them to the draft in `spec_info.hidden_states`), and where to write
`logits` [S, draft_vocab] and `aux` [S, H] (the hidden the next chain step reads).

The draft is built and loaded exactly as a server start does (sglang_judge: `ModelConfig` →
`_initialize_model` → `DefaultModelLoader.load_weights_and_postprocess`), then its own
`LlamaModel.forward` runs: embedding, `norm_before_fc` / `fc_norm`, `fc` (only when the widths differ),
the decoder layer's norms, concatenation and residuals, rotary embedding, qkv / o / gate_up / down
projections and the final norm — SGLang's code, their native torch paths (`forward_native`; the CPU
paths call `sgl_kernel`, which a CPU without it cannot import). Two pieces are not SGLang's, on purpose:
- the attention kernel: `RadixAttention.forward` needs an attention backend and a paged KV pool; one
  sequence's causal softmax(QKᵀ/√d)V (GQA) over the q, k, v SGLang's layer computed stands in for it;
- the logits: `LogitsProcessor` picks the last token of each request; here every position's logits are
  `norm(h) @ lm_head.weightᵀ` over the draft vocab, the matmul it does.
The verdict lists every use of a stand-in module during the forward (`stub_uses_during_forward`,
expected empty).
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
import types
from typing import Any

import sglang_judge as judge  # noqa: E402  (same folder; installs the stand-ins before sglang imports)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.model_loader.loader import DefaultModelLoader  # noqa: E402
from sglang.srt.runtime_context import get_spec  # noqa: E402


def causal_attention(self: RadixAttention, q, k, v, forward_batch, save_kv_cache: bool = True, **kwargs):
    """One sequence, causal, grouped-query: what a prefill (extend) backend computes for it."""
    s = q.shape[0]
    q = q.view(s, self.tp_q_head_num, self.head_dim).transpose(0, 1)
    k = k.view(s, self.tp_k_head_num, self.head_dim).transpose(0, 1)
    v = v.view(s, self.tp_v_head_num, self.head_dim).transpose(0, 1)
    rep = self.tp_q_head_num // self.tp_k_head_num
    k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
    return y.transpose(0, 1).reshape(s, self.tp_q_head_num * self.head_dim)


def native_ops(model: torch.nn.Module) -> list[str]:
    """Every CustomOp (RMSNorm, SiluAndMul, rotary) on its torch path; returns their class names."""
    names = []
    for module in model.modules():
        if hasattr(module, "forward_native") and hasattr(module, "_forward_method"):
            module._forward_method = module.forward_native
            names.append(type(module).__name__)
    return sorted(set(names))


class _Mode:
    """ForwardMode.EXTEND as the draft's forward asks about it (a prefill of one request, no images)."""

    def is_extend(self) -> bool:
        return True

    def is_decode(self) -> bool:
        return False

    def is_draft_extend_v2(self) -> bool:
        return False


def forward_batch(hidden_states: torch.Tensor) -> types.SimpleNamespace:
    """The fields `LlamaModel.forward` reads (the attention's are the stand-in's business)."""
    return types.SimpleNamespace(mm_input_embeds=None, forward_mode=_Mode(), contains_mm_inputs=lambda: False,
                                 spec_info=types.SimpleNamespace(hidden_states=hidden_states))


def run(request: dict[str, Any]) -> dict[str, Any]:
    # `--dtype float32`: under "auto" SGLang serves a float32 checkpoint in float16
    server_args = judge.publish_case(request["target"], request["draft"], dtype="float32")
    judge.init_distributed()
    config = ModelConfig.from_server_args(server_args, model_path=get_spec().speculative_draft_model_path,
                                          model_revision=get_spec().speculative_draft_model_revision,
                                          is_draft_model=True)
    model, loader = judge.build(config)
    DefaultModelLoader.load_weights_and_postprocess(model, loader._get_all_weights(config, model), judge.CPU)
    ops = native_ops(model)
    RadixAttention.forward = causal_attention
    x = load_file(request["inputs"])
    stubs = judge.stub_state()
    with torch.no_grad():
        dtype = next(model.parameters()).dtype
        h, aux = model.model(x["input_ids"], x["positions"], forward_batch(x["hidden_states"].to(dtype)))
        # ParallelLMHead pads its rows to a multiple of 64; LogitsProcessor keeps the draft vocab's
        logits = (h.float() @ model.lm_head.weight.float().T)[:, :model.config.draft_vocab_size]
    save_file({"logits": logits.contiguous(), "aux": aux[0].float().contiguous()}, request["out"])
    return {"version": judge.sglang.__version__, "model_class": type(model).__name__, "dtype": str(dtype),
            "native_ops": ops, "stub_uses_during_forward": judge.stub_uses_since(stubs)}


def main() -> int:
    request = json.load(sys.stdin)
    with contextlib.redirect_stdout(sys.stderr):
        try:
            out = run(request)
        except Exception as exc:
            out = {"error": judge.error(exc) + "\n" + traceback.format_exc()[-3000:]}
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
