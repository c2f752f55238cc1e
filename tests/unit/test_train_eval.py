"""τ while training (steps/lib/training/evaluate.py): the held-out split, τ_sim against the engine's own
chain drafting, the best checkpoint exported and named in the manifest, the log and progress."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from steps.lib.artifacts import target_dir
from steps.lib.metrics import accepted_prefix
from steps.lib.model.reference_engine import Engine, _State
from steps.lib.runtime import progress
from steps.lib.training.evaluate import held_out, simulated_acceptance
from steps.lib.training.plan import build_plan, make_batch
from steps.lib.training.ttt import loss_positions, ttt_loss
from steps.train import prepare, run
from tests.unit.test_train import LAYER_IDS, config, fresh_store, source  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_accepted_prefix_counts_the_leading_run_of_matches():
    m = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    assert accepted_prefix(m).tolist() == [2, 0, 4, 1]


def test_the_held_out_split_is_seeded_never_planned_and_empty_at_fraction_zero():
    lengths = {"a": [10] * 20, "b": [10] * 9, "c": [10]}
    held = held_out(lengths, 0.1, seed=3)
    assert held == held_out(lengths, 0.1, seed=3) and held != held_out(lengths, 0.1, seed=4)
    assert [len(held[k]) for k in "abc"] == [2, 1, 0]          # at least one, never a shard's only one
    plan = build_plan(lengths, epochs=2, seed=0, max_length=40, rows_per_batch=2, exclude=held)
    planned = {(name, seq) for name, rows in plan for row in rows for seq, _ in row}
    assert not planned & {(k, i) for k, v in held.items() for i in v}
    assert len(planned) == 30 - 3
    none = held_out(lengths, 0.0, seed=3)
    assert build_plan(lengths, epochs=1, seed=0, max_length=40, rows_per_batch=2, exclude=none) == \
        build_plan(lengths, epochs=1, seed=0, max_length=40, rows_per_batch=2)


def _train_a_little(setup, steps: int = 40):
    model = setup.model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for it in range(steps):
        name, rows = setup.plan[it % len(setup.plan)]
        loss, _, _ = ttt_loss(model, make_batch(setup.reader.load(name), rows, 64), setup.head_rows, steps=3,
                              decay=0.8)
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_tau_sim_equals_the_engines_chain_drafting_round_by_round(source, tmp_path):  # noqa: F811
    """Teacher forcing is exact on greedy data: a round's count equals what the engine's own chain
    (its draft cache, its own drafts fed back) gets verified against the target's greedy tokens."""
    store, ids = fresh_store(source, tmp_path)
    setup = prepare(config(eval_every=0), store, ids["target_id"], ids["hidden_id"], ids["vocab_id"])
    _train_a_little(setup)               # memorised training sequences: rounds that accept 0..k drafts
    k = 4
    name, rows = setup.plan[0]
    shard = setup.reader.load(name)
    batch = make_batch(shard, [rows[0][:1]], 64)                  # one sequence
    sim, walked = simulated_acceptance(setup.model.eval(), batch, k)
    target = LlamaForCausalLM.from_pretrained(target_dir(store, ids["target_id"])).eval()
    engine = Engine(target, None, setup.model, layer_ids=LAYER_IDS, num_steps=k)
    x, feats = batch.input_ids[0].tolist(), batch.aux[0]
    starts = loss_positions(batch, torch.ones_like(setup.model.t2d), k)[0][0].nonzero().flatten().tolist()

    def engine_round(p: int) -> int:     # engine round at n = p + 1: it has consumed x[0..p], proposes x[p+1]
        n = p + 1
        drafts = engine.draft_chain(_State(x=x[:n + 1], target_cache=None, feats=feats[:n]))
        truth = x[n + 1:n + 1 + k]
        return int(accepted_prefix(torch.tensor(drafts[:len(truth)]) == torch.tensor(truth)))

    hist = [0] * (k + 1)
    for p in starts:
        hist[engine_round(p)] += 1
    assert sum(hist) == sim.verify_steps == len(starts)
    assert hist == sim.histogram, (hist, sim.histogram)
    assert sim.histogram[1] and sum(sim.histogram[2:])   # not two all-zero histograms: chains accepted too
    # the decode walk: the engine decoding the span, its first token the target's, each round a + 1 tokens on
    assert starts == list(range(starts[0], starts[-1] + 1))       # one assistant span
    decoded, p = [0] * (k + 1), starts[0] + 1
    while p <= starts[-1]:
        a = engine_round(p)
        decoded[a] += 1
        p += a + 1
    assert decoded == walked.histogram and walked.verify_steps < sim.verify_steps, (decoded, walked.histogram)


def test_the_best_checkpoint_is_exported_and_the_log_manifest_and_progress_carry_tau_sim(source, tmp_path):  # noqa: F811
    store, ids = fresh_store(source, tmp_path)
    updates: list[progress.Update] = []
    with progress.listening(updates.append):
        cfg = config(lr=1e-2, epochs=4, eval_every=5, eval_fraction=0.2)
        m = run(cfg, store, **ids)
    cfg_k = cfg.serve.num_steps       # τ_sim drafts the served chain
    art = tmp_path / "store/artifacts/draft" / m.id
    log = [json.loads(line) for line in (art / "train_log.jsonl").open()]
    evals = [r for r in log if "tau_sim" in r]
    steps = m.metrics["steps"]
    assert [r["step"] + 1 for r in evals] == sorted({*range(5, steps + 1, 5), steps})
    best = max(evals, key=lambda r: r["tau_sim"])              # the first of equal ones
    assert m.metrics["tau_sim"] == m.metrics["tau_sim_best"] == best["tau_sim"]
    assert m.metrics["tau_sim_decode"] == best["tau_sim_decode"] and 0 < best["rounds_sim_decode"] < best["rounds_sim"]
    assert m.metrics["exported_step"] == m.metrics["best_step"] == best["step"] + 1
    assert m.metrics["tau_sim_last"] == evals[-1]["tau_sim"]
    assert all(1.0 <= r["tau_sim"] <= 5.0 and len(r["per_position_sim"]) == cfg_k for r in evals)
    assert any(isinstance(u.postfix.get("tau_sim"), float) and "@ step" in str(u.postfix.get("best"))
               for u in updates)
    assert not (art / "best-draft.safetensors").exists()
    # the same run exporting its last step (evaluation draws no random numbers, so the run is the same)
    last, ids2 = fresh_store(source, tmp_path, "last")
    m_last = run(config(lr=1e-2, epochs=4, eval_every=5, eval_fraction=0.2, keep_best=False), last, **ids2)
    assert m_last.metrics["exported_step"] == steps and m_last.metrics["tau_sim"] == evals[-1]["tau_sim"]
    exported = load_file(str(art / "model.safetensors"))
    final = load_file(str(tmp_path / "last/artifacts/draft" / m_last.id / "model.safetensors"))
    assert torch.equal(exported["fc.weight"], final["fc.weight"]) == (m.metrics["exported_step"] == steps)


def test_the_draft_starts_from_the_targets_head_rows_and_final_norm_when_asked(source, tmp_path):  # noqa: F811
    from safetensors.torch import save_file

    store, ids = fresh_store(source, tmp_path)
    src = target_dir(store, ids["target_id"])
    w = store.begin("target", "tgt-norm", step="target")                 # the same target, a non-unit norm
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, w.path(f.name))
    weights = load_file(str(src / "model.safetensors"))
    weights["model.norm.weight"] = torch.linspace(0.5, 1.5, weights["model.norm.weight"].numel())
    save_file(weights, str(w.path("model.safetensors")), metadata={"format": "pt"})
    w.commit(meta={"source": "tiny", "name": "tiny-test"})
    ids["target_id"] = "tgt-norm"
    setup = prepare(config(), store, ids["target_id"], ids["hidden_id"], ids["vocab_id"])
    d2t = setup.model.d2t
    head = weights["model.embed_tokens.weight"]                              # tied target
    assert torch.equal(setup.model.lm_head.weight, head[d2t + torch.arange(len(d2t))])
    assert torch.equal(setup.model.norm.weight, weights["model.norm.weight"])
    assert setup.model.norm.weight.requires_grad and setup.model.lm_head.weight.requires_grad   # still trained
    off = prepare(config(init_lm_head=False, init_norm=False), store, ids["target_id"], ids["hidden_id"],
                  ids["vocab_id"])
    assert torch.equal(off.model.norm.weight, torch.ones_like(off.model.norm.weight))
    assert not torch.equal(off.model.lm_head.weight, setup.model.lm_head.weight)
