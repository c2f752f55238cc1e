"""The anchor of issue 14: one optimizer step of speculators 0.9.0's EAGLE-3 draft, as its trainer runs it.

speculators (the vLLM project's trainer) runs only in this benchmark, from wheels carried to the GPU
machine (never in the base install). Its trainer step, as `speculators.train.trainer` does it: the
batch under `torch.autocast(bf16)`, `model(**batch, ttt_steps, ttt_step_loss_decay, loss_config)`,
`loss.backward()`, `clip_grad_norm_(1.0)`, AdamW step. The draft's `forward` is `torch.compile`d by
speculators itself on CUDA, with flex attention (its default). The loss is its eager KL
(`resolve_loss_config("kl_div", "eager")`): its fused Triton loss crashed under torch.compile on
PyTorch 2.11 (../shared/reference/gpu-anchors.md). speculators imports `openai` and `datasets` at
module level and never uses them in this step: `stand_in` serves empty modules for them when absent.
The batch is speculators' layout: one packed row of `tokens` (documents of `seq_len`), every
position trained at every TTT step.
"""

from __future__ import annotations

import time

import torch

from benchmarks.scaling import DRAFT_VOCAB, SHAPES
from benchmarks.stand_ins import stand_in


def build(shape: dict, draft_vocab: int, ttt: int, device: str, attn: str = "simple_flex_attention"):
    """speculators' Eagle3DraftModel at `shape` with random weights and a random draft vocab."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    layer = LlamaConfig(**shape, num_hidden_layers=1, max_position_embeddings=8192, rope_theta=500000.0,
                        rms_norm_eps=1e-5, tie_word_embeddings=False)
    layer._attn_implementation = attn
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab, norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=[2, 16, 29],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt)],
            default_proposal_method="greedy", verifier=VerifierConfig.from_config(layer, name_or_path=None)))
    torch.manual_seed(0)
    model = Eagle3DraftModel(cfg)
    with torch.no_grad():   # what `load_verifier_weights` copies from a verifier checkpoint (all frozen)
        for m in (model.embed_tokens, model.lm_head, model.verifier_lm_head):
            m.weight.normal_(0, 0.02)
    g = torch.Generator().manual_seed(1)
    ids = torch.randperm(shape["vocab_size"], generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(shape["vocab_size"], dtype=torch.bool)
    t2d[ids] = True
    model.load_vocab_mappings(t2d, ids - torch.arange(draft_vocab))
    return model.to(device)


def make_batch(shape: dict, tokens: int, seq_len: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    h = shape["hidden_size"]
    doc = torch.arange(tokens) // seq_len
    return {"hidden_states": torch.randn(1, tokens, 3 * h, generator=g).to(device, torch.bfloat16),
            "input_ids": torch.randint(0, shape["vocab_size"], (1, tokens), generator=g).to(device),
            "document_ids": doc[None].to(device),
            "loss_mask": torch.ones(1, tokens, dtype=torch.bool, device=device),
            "position_ids": (torch.arange(tokens) % seq_len)[None].to(device),
            "verifier_last_hidden_states": torch.randn(1, tokens, h, generator=g).to(device, torch.bfloat16)}


def bench_speculators(*, ttt: int, tokens: int, seq_len: int, iters: int, shape_name: str = "llama8b",
                      device: str = "cuda", attn: str = "simple_flex_attention") -> dict:
    """tokens/s of speculators' train step -> a row like gpu_perf's."""
    stood_in = stand_in()
    from speculators.losses import resolve_loss_config

    shape = SHAPES[shape_name]
    model = build(shape, DRAFT_VOCAB[shape_name], ttt, device, attn)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    batch = make_batch(shape, tokens, seq_len, device)
    kwargs = {"ttt_steps": ttt, "ttt_step_loss_decay": 1.0, "loss_config": resolve_loss_config("kl_div", "eager")}
    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def step() -> float:
        with torch.autocast(device, dtype=torch.bfloat16):
            _, loss, _ = model(**batch, **kwargs)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss.detach())

    first = [step() for _ in range(3)]                     # compiles
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / iters
    row = {"what": "train", "variant": "speculators 0.9.0 step", "ttt_steps": ttt, "tokens": tokens,
           "step_s": round(seconds, 4), "tokens_per_s": round(tokens / seconds),
           "trainable_params": sum(p.numel() for p in params), "first_losses": [round(x, 3) for x in first],
           "stand_ins": stood_in}
    if cuda:
        row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    return row
