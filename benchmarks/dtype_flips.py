"""How often the target's greedy token changes between a float32 and a bf16 forward (issue 23).

On a GPU the draft trains on the target's bf16 answers and hidden states (what serving runs), while verify
decodes in float32 unless `verify.dtype: bfloat16`. This counts, along the target's own float32 greedy answers
to held-out MT-bench first turns, the positions whose argmax differs between one float32 and one bf16 forward
over the whole sequence, and the float32 logit gap at each: how often the two greedy texts part ways, and how
large a `verify.tie_tolerance` a bf16 verify needs.

    python benchmarks/dtype_flips.py --store file:///tmp/store --target <target_id> [--prompts 6 --tokens 96]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--target", required=True, help="a target artifact id in the store")
    ap.add_argument("--config", default="smollm2-135m-h200-chat", help="whose verify section picks the prompts")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args(argv)
    import torch

    from steps.lib.artifacts import inference_device, load_target
    from steps.lib.data.prompts import held_out_prompts
    from steps.lib.store import open_store
    from steps.registry import open_config

    store, device = open_store(args.store), inference_device()
    fp32, tok = load_target(store, args.target, device=device)
    bf16, _ = load_target(store, args.target, device=device, dtype=torch.bfloat16)
    cfg, _ = open_config(args.config, [], args.store)
    positions, gaps = 0, []
    with torch.no_grad():
        for _, ids in held_out_prompts(cfg, tok)[:args.prompts]:
            seq = fp32.generate(torch.tensor([ids], device=device), max_new_tokens=args.tokens, do_sample=False)
            a = fp32(seq).logits[0, len(ids) - 1:].float()     # the positions that predict answer tokens
            b = bf16(seq).logits[0, len(ids) - 1:].float()
            top_a, top_b = a.argmax(-1), b.argmax(-1)
            gaps += [float(a[i, top_a[i]] - a[i, top_b[i]]) for i in (top_a != top_b).nonzero().flatten().tolist()]
            positions += len(top_a)
    print(json.dumps({"target": args.target, "device": device, "positions": positions, "flips": len(gaps),
                      "flip_share": len(gaps) / positions, "float32_gaps": sorted(round(g, 4) for g in gaps)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
