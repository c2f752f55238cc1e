"""Data efficiency (issue 12, item 3): does starting the draft's lm_head (and final norm) from the
target's help, on the same data? Trains one draft per variant on the same hidden/vocab artifacts (the
whole data, no held-out split taken out), exports each and measures τ with verify's engine on the
held-out MT-bench prompts and on training prompts (in distribution).

    .venv/bin/python benchmarks/init_ablation.py --config tiny --store file://out/store --train-prompts 8

Variants: `random` (init_lm_head=false, init_norm=false), `head` (lm_head rows from the target),
`head+norm` (the default: lm_head rows and the final norm from the target), `head+norm, head frozen`
(the head stays the target's rows, as speculators trains). Prints a table and writes
init_ablation.json in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality_parity import inputs, measure_dir, training_prompts  # noqa: E402

VARIANTS = {"random": ["train.init_lm_head=false", "train.init_norm=false"],
            "head": ["train.init_lm_head=true", "train.init_norm=false"],
            "head+norm": ["train.init_lm_head=true", "train.init_norm=true"],
            "head+norm, head frozen": ["train.init_lm_head=true", "train.init_norm=true", "train.freeze_lm_head=true"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--store", default="file://out/store")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument("--train-prompts", type=int, default=8)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", type=Path, default=Path("out/init_ablation"))
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from steps.lib.artifacts import export_dir, load_target
    from steps.lib.config import find_config, load_config
    from steps.lib.store import open_store, store_uri_for
    from steps.registry import run_step

    base = args.overrides + ["train.eval_every=0"]
    cfg = load_config(find_config(args.config), base)
    store = open_store(store_uri_for(args.store, cfg.store))
    ids = inputs(args.config, base, args.store)
    target, tokenizer = load_target(store, ids["target"])
    seen = training_prompts(store, ids["dataset"], tokenizer, args.train_prompts)
    rows = {}
    for name in args.variants:
        ov = base + VARIANTS[name]
        rec = run_step("train", args.config, ov, args.store, {k: ids[k] for k in ("target", "hidden", "vocab")})
        exp = run_step("export", args.config, ov, args.store, {"draft": rec["id"], "target": ids["target"]})
        d = export_dir(store, exp["id"], "sglang")
        (held, _), (train, _) = measure_dir(cfg, target, tokenizer, d), measure_dir(cfg, target, tokenizer, d, seen)
        rows[name] = {"tau_held_out": held["tau"], "per_position_held_out": held["per_position_acceptance"],
                      "tau_training_prompts": train["tau"], "train_acc": rec["metrics"]["acc"],
                      "final_loss": rec["metrics"]["final_loss"], "draft": rec["id"]}
        print(name, json.dumps(rows[name]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "init_ablation.json").write_text(json.dumps({"config": args.config, "overrides": args.overrides,
                                                             "inputs": ids, "rows": rows}, indent=2))
    print("| init | τ MT-bench (held out) | per position | τ training prompts | train top-1 (step 0) | loss |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['tau_held_out']:.3f} | {' / '.join(f'{a:.2f}' for a in r['per_position_held_out'])} | "
              f"{r['tau_training_prompts']:.3f} | {r['train_acc'][0]:.3f} | {r['final_loss']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
