"""Draft training throughput at SmolLM2-135M shapes (tokens/s of one TTT optimizer step).

    python benchmarks/train_throughput.py --ttt-steps 4,7 [--seq-len 512] [--iters 3]

Random inputs shaped like the demo (8192 tokens per step, two chat-like sequences per row, ~55%
answer tokens); on CUDA the step runs under bf16 autocast as train does. Results: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import time

import torch

from steps.lib.model.draft import DraftConfig, Eagle3Draft
from steps.lib.training.plan import Batch
from steps.lib.training.ttt import ttt_loss
from steps.mapping import build_vocab

TOKENS_PER_STEP = 8192


def synthetic_batch(cfg: DraftConfig, t2d: torch.Tensor, seq_len: int) -> Batch:
    rows = TOKENS_PER_STEP // seq_len
    split = seq_len // 2 + 37                         # two documents per row
    doc = torch.zeros(rows, seq_len, dtype=torch.int64)
    pos = torch.zeros(rows, seq_len, dtype=torch.int64)
    mask = torch.zeros(rows, seq_len, dtype=torch.bool)
    for r in range(rows):
        doc[r, split:] = 1
        pos[r, :split], pos[r, split:] = torch.arange(split), torch.arange(seq_len - split)
        mask[r, int(0.45 * split):split] = True       # a prompt, then an answer, in each document
        mask[r, split + int(0.45 * (seq_len - split)):] = True
    ids = t2d.nonzero().flatten()[torch.randint(0, cfg.draft_vocab_size, (rows, seq_len))]
    return Batch(ids, mask, doc, pos, torch.randn(rows, seq_len, cfg.num_aux * cfg.target_hidden_size),
                 torch.randn(rows, seq_len, cfg.target_hidden_size))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ttt-steps", default="4,7")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                      vocab_size=49152, draft_vocab_size=8192, target_hidden_size=576, num_aux=3)
    d2t, t2d = build_vocab(torch.randint(0, 100, (49152,)), 49152, 8192)
    model = Eagle3Draft.from_target({"embed_tokens.weight": torch.randn(49152, 576) * 0.02}, cfg, d2t, t2d).to(device)
    head_rows = (torch.randn(8192, 576) * 0.05).to(device)
    batch = Batch(*(getattr(synthetic_batch(cfg, t2d, args.seq_len), f).to(device) for f in Batch.__dataclass_fields__))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.95))
    print(f"device {device}, threads {torch.get_num_threads()}, seq_len {args.seq_len}")
    for k in (int(x) for x in args.ttt_steps.split(",")):
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss, _, _ = ttt_loss(model, batch, head_rows, steps=k, decay=0.8)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        best = min(times[1:] or times)                # the first step includes warm-up
        print(f"ttt_steps={k}: {best:.3f} s/step, {TOKENS_PER_STEP / best:,.0f} tokens/s")


if __name__ == "__main__":
    main()
