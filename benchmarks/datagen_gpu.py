"""Datagen on a GPU: today's decode loop against the static-cache path, side by side in one run.

Both answer the same chat-templated training prompts of SmolLM2-135M-Instruct (the embedded default),
sorted by length and batched as datagen batches them, greedy, up to `--new-tokens` tokens each:

- `loop fp32`: `steps.lib.model.decode.decode` in float32 (what datagen ran on the H200 so far);
- `static fp32`, `static bf16`: `decode_static` (transformers' static cache, compiled into CUDA graphs), in
  float32 (the same answers, to isolate the path) and bfloat16 (the dtype production serves), at batch
  `--batch` and `--big-batch`.

Answer tok/s counts the tokens the answers keep (stop token included, padding rows and slots after a
row's stop excluded), over wall time from the first prefill to the last token, compile time reported
apart (the first batch of a shape). Agreement: the fraction of prompts whose greedy answer equals the
loop's token for token.

Two stages, because the GPU machine has neither the package nor the config system:

    # here: render the prompts (token ids) and split the GGUF to travel
    python benchmarks/datagen_gpu.py render --config smollm2-135m-h200 -n 2048 --out .devdata/prompts.json
    # on the GPU machine (the GGUF reassembled into .devdata/):
    python3 benchmarks/datagen_gpu.py measure --gguf .devdata/SmolLM2-135M-Instruct.Q4_1.gguf \
        --prompts .devdata/prompts.json --out $OUT/datagen-gpu.jsonl
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

from steps.lib.model.decode import decode, decode_static  # noqa: E402


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


def _run(name: str, model: torch.nn.Module, prompts: list[list[int]], batch: int, data: dict, new_tokens: int,
         static: bool) -> tuple[dict, list[list[int]]]:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[list[int] | None] = [None] * len(prompts)
    compile_s, t_first = 0.0, None
    _sync()
    t0 = time.perf_counter()
    for b in range(0, len(order), batch):
        idx = order[b:b + batch]
        tb = time.perf_counter()
        batch_prompts = [prompts[i] for i in idx]
        if static:
            out = decode_static(model, batch_prompts, new_tokens, data["stops"], data["pad"],
                                max_prompt_tokens=data["max_prompt_tokens"], batch_rows=batch)
        else:
            out = decode(model, batch_prompts, new_tokens, data["stops"], data["pad"])
        _sync()
        if b == 0:
            t_first = time.perf_counter() - tb
        for i, a in zip(idx, out, strict=True):
            answers[i] = a.tokens + ([data["stops"][0]] if a.finished else [])
    wall = time.perf_counter() - t0
    if static:
        # the first batch of a shape compiles: time it again now that the graph exists
        tb = time.perf_counter()
        decode_static(model, [prompts[i] for i in order[:batch]], new_tokens, data["stops"], data["pad"],
                      max_prompt_tokens=data["max_prompt_tokens"], batch_rows=batch)
        _sync()
        compile_s = max(0.0, t_first - (time.perf_counter() - tb))
    tokens = sum(len(a) for a in answers)
    steady = wall - compile_s
    row = {"variant": name, "batch": batch, "prompts": len(prompts), "answer_tokens": tokens,
           "wall_s": round(wall, 2), "compile_s": round(compile_s, 2), "tok_s": round(tokens / wall),
           "tok_s_after_compile": round(tokens / steady) if steady > 0 else None,
           "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu", "torch": torch.__version__}
    return row, answers


def measure(args: argparse.Namespace) -> None:
    import transformers
    from transformers import AutoModelForCausalLM

    data = json.loads(Path(args.prompts).read_text())
    prompts = data["prompts"][: args.n]
    gguf = Path(args.gguf)
    base = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    variants = [("loop fp32", torch.float32, args.batch, False), ("static fp32", torch.float32, args.batch, True),
                ("static bf16", torch.bfloat16, args.batch, True),
                ("static bf16", torch.bfloat16, args.big_batch, True)]
    loop: tuple[list[list[int]], int] | None = None      # the loop's answers and rate: what the others match
    with out.open("w") as f:
        for name, dtype, batch, static in variants:
            model = base.to(DEVICE, dtype=dtype)           # fp32 variants first: bf16 converts in place
            row, answers = _run(name, model, prompts, batch, data, args.new_tokens, static)
            loop = loop or (answers, row["tok_s"])
            row["same_as_loop"] = round(sum(a == r for a, r in zip(answers, loop[0], strict=True)) / len(prompts), 3)
            row["speedup_vs_loop"] = round(row["tok_s"] / loop[1], 2)
            row["transformers"] = transformers.__version__
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render")
    r.add_argument("--config", default="smollm2-135m-h200")
    r.add_argument("-n", type=int, default=2048)
    r.add_argument("--out", default=".devdata/prompts.json")
    m = sub.add_parser("measure")
    m.add_argument("--gguf", required=True)
    m.add_argument("--prompts", required=True)
    m.add_argument("-n", type=int, default=2048)
    m.add_argument("--new-tokens", type=int, default=256)
    m.add_argument("--batch", type=int, default=256)
    m.add_argument("--big-batch", type=int, default=1024)
    m.add_argument("--out", default="out/datagen-gpu.jsonl")
    args = p.parse_args()
    render(args) if args.cmd == "render" else measure(args)


if __name__ == "__main__":
    main()
