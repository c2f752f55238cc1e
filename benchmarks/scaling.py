"""Multi-GPU scaling: draft-training and extraction tokens/s at N GPUs, 8B-shaped, random weights.

    python benchmarks/scaling.py --what train,extract --layers 32                     # 1 GPU, unwrapped
    torchrun --nproc-per-node N benchmarks/scaling.py --what train,extract --layers 32 --out scaling.jsonl

Training runs the step `steps.train` runs (`train_step`: loss over the global count of predictions,
DDP or FSDP from `steps.lib.runtime.distributed`, bf16 autocast, AdamW, clipping) on the EAGLE-3 draft of a
Llama-3.1-8B-shaped target (H 4096, 32/8 heads, MLP 14336, target vocab 128256, draft vocab 32000,
3 aux layers), `--tokens-per-gpu` tokens per rank per step (weak scaling: the global batch grows with
N, as it does when a run is given more GPUs). `--shape h7168` is the 7168-wide draft of the founding
MoE case (FSDP territory). Extraction runs the target itself (random bf16 weights, `--layers` decoder
layers, one replica per rank) through `steps.lib.extraction.capture.LocalBackend` (hooks on the aux layers and the
final norm; states copied to the host as the step does), then writes the shard (`steps.lib.data.shards`, bf16)
to local disk, timed apart. Throughput is the job's: all ranks' tokens over the slowest rank's
median time. Rank 0 prints one JSON line per measurement (and appends it to `--out`), then a table.
`--group` joins a process group even at one rank, to measure the DDP/FSDP wrappers' own cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from steps.lib.config import parse_config
from steps.lib.layer_ids import default_aux_layer_ids
from steps.lib.model.draft import DraftConfig, Eagle3Draft
from steps.lib.runtime import distributed
from steps.lib.training.loop import Setup, build_trainer, train_step
from steps.lib.training.plan import Batch
from steps.mapping import build_vocab

#: target shapes (the draft's decoder layer takes the same); `tiny` is a CPU smoke test of this script.
SHAPES = {
    "llama8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256},
    "h7168": {"hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64,
              "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 163840},
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 4096},
}
#: draft vocab per shape: 32k for the real ones (EAGLE-3's usual size).
DRAFT_VOCAB = {"llama8b": 32000, "h7168": 32000, "tiny": 1024}


def sync(world: distributed.World) -> None:
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)


def timed(world: distributed.World, fn, *, warmup: int, iters: int) -> float:
    """Median seconds of `fn()` after `warmup` calls (the first ones compile kernels, grow the cache)."""
    times = []
    for i in range(warmup + iters):
        sync(world)
        t0 = time.perf_counter()
        fn()
        sync(world)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def job_rate(world: distributed.World, tokens: float, seconds: float) -> tuple[float, float]:
    """(tokens/s of the job, slowest rank's seconds): ranks step together, the slowest sets the pace."""
    total, = distributed.all_reduce_sum(world, [tokens])
    slowest = max(distributed.all_gather_object(world, seconds))
    return total / slowest, slowest


# --- training ------------------------------------------------------------------------------------------

def draft_config(shape: dict, draft_vocab: int) -> DraftConfig:
    h = shape["hidden_size"]
    return DraftConfig(hidden_size=h, intermediate_size=shape["intermediate_size"],
                       num_attention_heads=shape["num_attention_heads"],
                       num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"],
                       rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                       vocab_size=shape["vocab_size"], draft_vocab_size=draft_vocab, target_hidden_size=h, num_aux=3)


def synthetic_batch(cfg: DraftConfig, t2d: torch.Tensor, *, tokens: int, seq_len: int, seed: int) -> Batch:
    """Rows of two chat-like documents each (a prompt, then ~55% answer tokens), random hidden states."""
    g = torch.Generator().manual_seed(seed)
    rows, split = max(1, tokens // seq_len), seq_len // 2 + 37
    doc = torch.zeros(rows, seq_len, dtype=torch.int64)
    doc[:, split:] = 1
    pos = torch.cat([torch.arange(split), torch.arange(seq_len - split)]).expand(rows, -1).clone()
    mask = torch.zeros(rows, seq_len, dtype=torch.bool)
    mask[:, int(0.45 * split):split] = True
    mask[:, split + int(0.45 * (seq_len - split)):] = True
    ids = t2d.nonzero().flatten()[torch.randint(0, cfg.draft_vocab_size, (rows, seq_len), generator=g)]
    return Batch(ids, mask, doc, pos, torch.randn(rows, seq_len, cfg.num_aux * cfg.target_hidden_size, generator=g),
                 torch.randn(rows, seq_len, cfg.target_hidden_size, generator=g))


def bench_train(world: distributed.World, args: argparse.Namespace, parallel: str) -> dict:
    dcfg = draft_config(SHAPES[args.shape], DRAFT_VOCAB[args.shape])
    cfg = parse_config({"name": "scaling", "target": {"source": "tiny"},
                        "train": {"ttt_steps": args.ttt_steps, "parallel": "ddp" if parallel == "none" else parallel}})
    d2t, t2d = build_vocab(torch.randint(0, 1000, (dcfg.vocab_size,), generator=torch.Generator().manual_seed(0)),
                           dcfg.vocab_size, dcfg.draft_vocab_size)
    torch.manual_seed(0)                                   # the same initial draft on every rank
    with torch.device(world.device):
        draft = Eagle3Draft(dcfg)
        draft.embed_tokens.weight.normal_(0, 0.02)
        head_rows = torch.randn(dcfg.draft_vocab_size, dcfg.target_hidden_size) * 0.02
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    if world.device.type == "cuda" and torch.cuda.is_initialized():    # nothing to reset before the first use
        torch.cuda.reset_peak_memory_stats(world.device)
    tr = build_trainer(cfg.train, Setup(draft, head_rows, None, [], {}), world)
    batch = synthetic_batch(dcfg, t2d, tokens=args.tokens_per_gpu, seq_len=args.seq_len, seed=world.rank)
    batch = Batch(*(getattr(batch, f).to(world.device) for f in Batch.__dataclass_fields__))
    seconds = timed(world, lambda: train_step(tr, batch, t=cfg.train, lr=1e-4), warmup=args.warmup, iters=args.iters)
    rate, slowest = job_rate(world, batch.tokens, seconds)
    return {"what": "train", "shape": args.shape, "gpus": world.size, "parallel": tr.parallel,
            "ttt_steps": args.ttt_steps, "tokens_per_gpu": batch.tokens, "step_s": round(slowest, 4),
            "tokens_per_s": round(rate), "trainable_params": distributed.trainable_params(draft),
            "peak_mem_gib": _peak_gib(world)}


# --- extraction ----------------------------------------------------------------------------------------

def random_target(world: distributed.World, shape: dict, layers: int) -> torch.nn.Module:
    """A Llama with the target's shape and `layers` decoder layers, random bf16 weights on this rank's device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, num_hidden_layers=layers, max_position_embeddings=8192,
                      rope_theta=500000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(world.device):
            return LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)


def bench_extract(world: distributed.World, args: argparse.Namespace) -> dict:
    from steps.lib.data.shards import write_shard
    from steps.lib.extraction.capture import LocalBackend

    shape = SHAPES[args.shape]
    layer_ids = default_aux_layer_ids(args.layers)
    if world.device.type == "cuda" and torch.cuda.is_initialized():    # nothing to reset before the first use
        torch.cuda.reset_peak_memory_stats(world.device)
    backend = LocalBackend(random_target(world, shape, args.layers), layer_ids)
    g = torch.Generator().manual_seed(100 + world.rank)
    seqs = torch.randint(0, shape["vocab_size"], (args.extract_batch, args.seq_len), generator=g).tolist()
    tokens = args.extract_batch * args.seq_len
    out: dict = {}

    def capture():
        out["states"] = backend.capture(seqs)

    capture_s = timed(world, capture, warmup=args.warmup, iters=args.iters)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard-00000.safetensors"
        aux = torch.cat([a for a, _ in out["states"]])
        final = torch.cat([f for _, f in out["states"]])
        write_s = timed(world, lambda: write_shard(path, seqs, [[1] * args.seq_len] * len(seqs), aux, final,
                                                   layer_ids=layer_ids), warmup=1, iters=max(1, args.iters // 2))
    rate, slowest = job_rate(world, tokens, capture_s)
    with_write, _ = job_rate(world, tokens, capture_s + write_s)
    return {"what": "extract", "shape": args.shape, "gpus": world.size, "layers": args.layers,
            "tokens_per_gpu": tokens, "capture_s": round(slowest, 4), "tokens_per_s": round(rate),
            "tokens_per_s_with_write": round(with_write), "write_s": round(write_s, 4),
            "peak_mem_gib": _peak_gib(world)}


def _peak_gib(world: distributed.World) -> float | None:
    if world.device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(world.device) / 2**30, 1)


# --- the run -----------------------------------------------------------------------------------------------

def report(world: distributed.World, rec: dict, out: str | None) -> None:
    if not world.is_main:
        return
    print(json.dumps(rec), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--what", default="train,extract", help="comma list: train, extract")
    p.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=32, help="target decoder layers for extraction (32 = 8B)")
    p.add_argument("--parallel", default="auto", help="comma list of none|ddp|fsdp|auto for training")
    p.add_argument("--group", action="store_true", help="join a process group even at one rank (wrapper cost)")
    p.add_argument("--tokens-per-gpu", type=int, default=16384, help="training tokens per rank per step")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--extract-batch", type=int, default=8, help="sequences of --seq-len per capture call")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None, help="append each JSON record to this file (rank 0)")
    args = p.parse_args(argv)
    world = distributed.setup("auto", group=args.group or None)
    rows = []
    try:
        for what in args.what.split(","):
            if what == "train":
                for mode in args.parallel.split(","):
                    rows.append(bench_train(world, args, mode))
                    report(world, rows[-1], args.out)
                    if world.device.type == "cuda":
                        torch.cuda.empty_cache()
            elif what == "extract":
                rows.append(bench_extract(world, args))
                report(world, rows[-1], args.out)
            else:
                raise SystemExit(f"--what: unknown {what!r}; use train and/or extract")
    finally:
        distributed.shutdown()
    if world.is_main:
        for r in rows:
            print(f"{r['what']:8s} {r['shape']:8s} gpus={r['gpus']} {r.get('parallel', ''):5s} "
                  f"{r['tokens_per_s']:>10,} tok/s  peak {r['peak_mem_gib']} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
