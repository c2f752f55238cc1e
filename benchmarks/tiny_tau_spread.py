"""How much the tiny pipeline's trained τ moves with the seed and the thread count.

The e2e test asserts that the tiny demo's trained draft beats an untrained one; the margin it may
ask for has to come from the spread measured here, not from one machine's number (a margin of 0.4
held on one machine, τ 1.53, and failed on the next, τ 1.35). For each (seed, torch threads) this
runs target → datagen → extract → mapping → train → export → verify in this process, each in its own
store (nothing shared), plus the untrained control (`train.max_steps=0`) and the trained draft served
the F1 way (`--speculative-algorithm EAGLE`: the reference engine as SGLang runs it then).

    .venv/bin/python benchmarks/tiny_tau_spread.py --seeds 0 1 2 --threads 1 2 --out /tmp/spread.jsonl

Prints one JSON line per run and a summary (min / max of each τ); results are written down in
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def run_chain(seed: int, threads: int, root: Path) -> dict:
    import torch

    from steps.lib.artifacts import export_dir, load_target
    from steps.lib.data.prompts import held_out_prompts
    from steps.lib.formats.sglang import sglang_layer_ids
    from steps.lib.formats.sglang_loader import load_sglang_draft
    from steps.lib.model.reference_engine import Engine
    from steps.lib.store import open_store
    from steps.registry import run_step
    from steps.verify import measure

    torch.set_num_threads(threads)
    store_uri, overrides = f"file://{root}", [f"seed={seed}"]
    os.environ["EAGLENEST_CACHE"] = str(root / "cache")
    ids, seconds = {}, {}

    def step(name: str, extra: list[str] | None = None, **inputs: str) -> dict:
        rec = run_step(name, "tiny", overrides + (extra or []), store_uri, inputs)
        seconds[name] = seconds.get(name, 0.0) + rec["seconds"]
        return rec

    t0 = time.perf_counter()
    ids["target"] = step("target")["id"]
    ids["dataset"] = step("datagen", target=ids["target"])["id"]
    ids["hidden"] = step("extract", target=ids["target"], dataset=ids["dataset"])["id"]
    ids["vocab"] = step("mapping", dataset=ids["dataset"], target=ids["target"])["id"]
    taus = {}
    for label, extra in (("trained", []), ("untrained", ["train.max_steps=0"])):
        draft = step("train", extra, target=ids["target"], hidden=ids["hidden"], vocab=ids["vocab"])["id"]
        export = step("export", extra, draft=draft, target=ids["target"])["id"]
        verify = step("verify", extra, export=export, target=ids["target"])
        taus[label] = verify["metrics"]["tau"]
        if label == "trained":
            trained_export = export

    # the trained draft behind --speculative-algorithm EAGLE (F1), on the same held-out prompts
    from steps.lib.config import find_config, load_config

    cfg = load_config(find_config("tiny"), overrides)
    store = open_store(store_uri)
    target, tokenizer = load_target(store, ids["target"])
    sglang_dir = export_dir(store, trained_export, "sglang")
    draft, _ = load_sglang_draft(sglang_dir, target=target)
    engine = Engine(target, tokenizer, draft, layer_ids=sglang_layer_ids(sglang_dir),
                    num_steps=cfg.verify.num_steps, algorithm="EAGLE")
    total, _ = measure(engine, held_out_prompts(cfg, tokenizer), cfg.verify.max_new_tokens, tokenizer.eos_token_id)
    return {"seed": seed, "threads": threads, "tau": taus["trained"], "tau_untrained": taus["untrained"],
            "tau_eagle_flag": total.tau, "wall_s": round(time.perf_counter() - t0, 1),
            "step_s": {k: round(v, 1) for k, v in seconds.items()}, "machine": platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    args = ap.parse_args(argv)
    rows = []
    for seed in args.seeds:
        for threads in args.threads:
            with tempfile.TemporaryDirectory(prefix="eaglenest-spread-") as tmp:
                row = run_chain(seed, threads, Path(tmp))
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    for key in ("tau", "tau_untrained", "tau_eagle_flag"):
        values = [r[key] for r in rows]
        print(f"{key}: min {min(values):.3f}  max {max(values):.3f}  over {len(values)} runs")
    gaps = [r["tau"] - r["tau_untrained"] for r in rows]
    print(f"trained - untrained: min {min(gaps):.3f}  max {max(gaps):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
