"""Train speculators 0.9.0's `Eagle3DraftModel` on batches the parity harness prepared; runs in
.venv-speculators (scripts/setup-speculators-venv.sh), started by benchmarks/quality_parity.py.

Only speculators, torch and transformers are imported here (never eaglenest). The harness writes, per
optimizer step, one safetensors file in speculators' own training layout (`speculators.models.eagle3.
data.shift_batch` already applied: token x[p+1] beside the aux states of p, the verifier's final state
of p+1, position ids from 1, sequences packed into one row with `document_ids`) and `plan.json` with
the learning rate of each step and the settings. This script builds the model the way
`Eagle3DraftModel.from_training_args` does (target embedding and lm_head rows copied and frozen, the
verifier's final norm for the targets), runs its own `forward` (TTT unroll and loss) and AdamW with
the given schedule, and saves with `save_pretrained` (speculators' on-disk format).

    .venv-speculators/bin/python benchmarks/speculators_driver.py WORK_DIR OUT_DIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script in the side venv
from benchmarks.stand_ins import stand_in  # noqa: E402


def next_batch(work: Path, step: int, limit_s: float = 900.0) -> dict:
    """Step `step`'s batch, waiting for the harness to write it (it writes a few steps ahead and renames
    each file into place when complete); the file is removed once read, so the disk holds a few steps."""
    from safetensors.torch import load_file

    path, waited = work / f"step-{step:06d}.safetensors", 0.0
    while not path.exists():
        if waited > limit_s:
            raise TimeoutError(f"{path}: not written after {limit_s:.0f} s")
        time.sleep(0.02)
        waited += 0.02
    batch = load_file(str(path))
    path.unlink()
    return batch


def main(work: Path, out: Path) -> None:
    stand_in()
    import torch
    from safetensors.torch import load_file
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.models.utils import resolve_draft_intermediate_size
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig

    plan = json.loads((work / "plan.json").read_text())
    torch.manual_seed(plan["seed"])
    torch.set_num_threads(plan.get("threads", torch.get_num_threads()))
    verifier = plan["target_dir"]
    # The draft layer's config as `speculators.train.cli.create_transformer_layer_config` builds it for
    # `--num-layers 1 --full-attention-indices 0` (that module needs httpx & co. to import): the
    # verifier's Llama config, one layer, its MLP width (`resolve_draft_intermediate_size`), an untied
    # head, full attention (sequences here are far below its 2048-token sliding window anyway).
    tl_config = AutoConfig.from_pretrained(verifier)
    tl_config.num_hidden_layers = 1
    tl_config.intermediate_size = resolve_draft_intermediate_size(tl_config)
    tl_config.tie_word_embeddings = False
    tl_config.layer_types = ["full_attention"]
    tl_config._attn_implementation = "sdpa"          # flex attention needs a GPU compile; same masks
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=tl_config, draft_vocab_size=plan["draft_vocab_size"],
        # plain EAGLE-3, the architecture SGLang serves and eaglenest trains (the EAGLE-3.1 flags have
        # no place in an SGLang draft: eaglenest convert refuses them)
        norm_before_residual=False, norm_before_fc=False, fc_norm=False, norm_output=False,
        embed_requires_grad=False, eagle_aux_hidden_state_layer_ids=plan["layer_ids"],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=plan["ttt_steps"])],
            default_proposal_method="greedy", verifier=VerifierConfig.from_pretrained(verifier)))
    model = Eagle3DraftModel(config=config)
    vocab = load_file(str(work / "vocab.safetensors"))
    model.load_vocab_mappings(vocab["t2d"], vocab["d2t"])
    model.load_verifier_weights()                     # embedding, lm_head rows (frozen), verifier norm
    # eaglenest's shards hold HF hidden_states[-1], already through the target's final norm
    model.verifier_norm = torch.nn.Identity()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).train()
    loss_config = resolve_loss_config(plan["loss_fn"], "eager")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=plan["lrs"][0], betas=tuple(plan["betas"]), weight_decay=plan["weight_decay"])
    log, train_s, tokens = [], 0.0, 0
    for step, lr in enumerate(plan["lrs"]):
        batch = {k: v.to(device) for k, v in next_batch(work, step).items()}
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr
        _, loss, metrics = model(
            hidden_states=batch["hidden_states"], input_ids=batch["input_ids"], document_ids=batch["document_ids"],
            loss_mask=batch["loss_mask"], position_ids=batch["position_ids"],
            verifier_last_hidden_states=batch["verifier_last_hidden_states"], ttt_steps=plan["ttt_steps"],
            ttt_step_loss_decay=plan["step_decay"], loss_config=loss_config)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, plan["grad_clip"])
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        train_s += time.perf_counter() - t0
        tokens += int(batch["input_ids"].shape[1])
        acc = [float(metrics[f"full_acc_{j}_sum"]) / max(1.0, float(metrics[f"full_acc_{j}_total"]))
               for j in range(plan["ttt_steps"])]
        log.append({"step": step, "loss": float(loss), "acc": acc, "lr": lr})
        print(json.dumps(log[-1]), flush=True)
    model.save_pretrained(str(out))
    (out / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    (out / "train_summary.json").write_text(json.dumps({"train_s": train_s, "tokens": tokens, "steps": len(log),
                                                        "trainable_params": sum(p.numel() for p in params)}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
