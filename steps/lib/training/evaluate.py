"""τ while training: the simulated acceptance length (τ_sim) of the draft on a held-out split of the
hidden states, and the choice of the best checkpoint by it (SpecForge's `simulated_acc_len`, NeMo
Automodel's `tau_sim`: loss and top-1 accuracy do not say how many drafts a server will accept).

The held-out split: `train.eval_fraction` of each shard's sequences, chosen with the run's seed before
the plan is built, never trained on (`held_out`); at most `train.eval_max_tokens` of them are
evaluated (`EvalSet`, read once and kept in memory).

τ_sim, teacher forced: every position p whose next-but-one token x[p+2] is an assistant token starts
one simulated verify round. The draft runs the same training-time-test unroll it is trained with
(`ttt_unroll`, k = `serve.num_steps` steps, the served chain), chain step j fed the real token x[p+1+j]; its drafted
target id at step j is compared with x[p+2+j]. The data is regenerated greedily by the target, so
x[p+2+j] is the target's argmax there and, while every earlier draft was accepted, x[p+1+j] is what
the engine would have fed. The accepted count of a round is `steps.lib.metrics.accepted_prefix` — the
rule the reference engine verifies with — and τ comes from `AcceptStats`, as verify's does. A chain
running past the end of its assistant span stops there (a lower bound).

Two means of those rounds are reported. `tau_sim` starts a round at every assistant position: the most
rounds, the steadiest figure, so the best checkpoint is chosen by it. `tau_sim_decode` keeps the rounds a
decoder would run (`decode_walk`: from a span's second token, each round a + 1 tokens on), which is what
verify counts on such data: a run of easy tokens is one round to a decoder but one round per position to
`tau_sim`, so where acceptance varies along a span `tau_sim` is the higher of the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from steps.lib.config import TrainConfig
from steps.lib.data.shards import save_sorted
from steps.lib.metrics import AcceptStats, accepted_prefix
from steps.lib.model.draft import Eagle3Draft
from steps.lib.runtime import distributed
from steps.lib.training.checkpoint import BEST_FILE, fp32_state
from steps.lib.training.plan import Batch, ShardReader, make_batch, pack
from steps.lib.training.trainer import Trainer
from steps.lib.training.ttt import loss_positions, ttt_unroll


def held_out(shard_lengths: dict[str, list[int]], fraction: float, seed: int) -> dict[str, set[int]]:
    """Sequence indices of each shard kept out of training: a seeded `fraction` of each shard (at least
    one where the shard has two or more sequences and fraction > 0; none when fraction is 0)."""
    out: dict[str, set[int]] = {}
    for k, name in enumerate(sorted(shard_lengths)):
        n = len(shard_lengths[name])
        take = 0 if fraction <= 0 or n < 2 else min(n - 1, max(1, round(fraction * n)))
        g = torch.Generator().manual_seed(seed * 7_919 + k)
        out[name] = set(torch.randperm(n, generator=g)[:take].tolist())
    return out


@dataclass
class EvalSet:
    """Held-out rows, packed like training rows (same `max_length`), one batch per shard."""
    batches: list[Batch]

    @property
    def tokens(self) -> int:
        return sum(b.tokens for b in self.batches)


def load_eval_set(reader: ShardReader, shard_lengths: dict[str, list[int]], held: dict[str, set[int]], *,
                  max_length: int, max_tokens: int) -> EvalSet:
    """Read the held-out sequences (in shard order) until `max_tokens`; the shards are read once."""
    batches, left = [], max_tokens
    for name in sorted(held):
        if left <= 0:
            break
        lengths = shard_lengths[name]
        chosen = []
        for i in sorted(held[name]):
            if left <= 0:
                break
            chosen.append(i)
            left -= min(lengths[i], max_length)
        if chosen:
            batches.append(make_batch(reader.load(name), pack(lengths, chosen, max_length), max_length))
    return EvalSet(batches)


def decode_walk(starts: Tensor, accepted: Tensor) -> Tensor:
    """bool [B, L]: the rounds a decoder would run over each assistant span, given every position's accepted
    count. `starts` marks the positions a round can start at (x[p+2] an assistant token), a run of them one
    span; the target writes a span's first token itself, so the first round starts one position in, and a
    round accepting a drafts moves the next start a + 1 positions on (the bonus token included)."""
    walk = []
    for row, acc in zip(starts.tolist(), accepted.tolist(), strict=True):
        marks, inside, round_at = [], False, -1
        for p, (ok, a) in enumerate(zip(row, acc, strict=True)):
            if ok and not inside:
                round_at = p + 1                        # the span's first token is the target's own
            inside = ok
            marks.append(ok and p == round_at)
            if marks[-1]:
                round_at = p + a + 1
        walk.append(marks)
    return torch.tensor(walk, dtype=torch.bool).view_as(starts)


@torch.no_grad()
def simulated_acceptance(model: Eagle3Draft, batch: Batch, num_steps: int) -> tuple[AcceptStats, AcceptStats]:
    """Teacher-forced accept counts of every round a batch holds (see the module docstring) -> (every
    position's round, the rounds of a decode walk over each span: `decode_walk`)."""
    # in_span[j][b, p]: x[p+2+j] is an assistant token of p's sequence (no draft-vocab condition: a token
    # outside the draft vocab is simply never matched)
    in_span = loss_positions(batch, torch.ones_like(model.t2d), num_steps)
    length = batch.doc.shape[1]
    match = []
    for j, (out, lay) in enumerate(ttt_unroll(model, batch, num_steps, in_span)):
        b, p = in_span[j].nonzero(as_tuple=True)
        ok = torch.zeros_like(in_span[j])
        if len(b):
            drafted = model.draft_to_target(model.compute_logits(out[b, lay.inv[b, p]]).argmax(-1))
            ok[b, p] = drafted == batch.input_ids[b, (p + 2 + j).clamp(max=length - 1)]
        match.append(ok)
    accepted = accepted_prefix(torch.stack(match, -1))
    walk = decode_walk(in_span[0].cpu(), accepted.cpu()).to(accepted.device)
    every, walked = (AcceptStats(num_steps, torch.bincount(accepted[m], minlength=num_steps + 1).tolist())
                     for m in (in_span[0], walk))
    return every, walked


def evaluate(model: Eagle3Draft, eval_set: EvalSet, num_steps: int) -> dict[str, Any]:
    """τ_sim and per-position acceptance of the held-out split (the draft left in training mode after)."""
    was_training = model.training
    model.eval()
    every, walked = AcceptStats(num_steps), AcceptStats(num_steps)
    for batch in eval_set.batches:
        a, w = simulated_acceptance(model, batch.to(model.d2t.device), num_steps)
        every.merge(a)
        walked.merge(w)
    model.train(was_training)
    return {"tau_sim": every.tau, "per_position_sim": every.per_position, "rounds_sim": every.verify_steps,
            "tau_sim_decode": walked.tau, "per_position_sim_decode": walked.per_position,
            "rounds_sim_decode": walked.verify_steps}


def due(step: int, total: int, every: int) -> bool:
    """Evaluate after optimizer step `step` (1-based)? Every `every` steps and after the last one."""
    return every > 0 and (step % every == 0 or step == total)


def better(tau: float, best: dict[str, Any] | None) -> bool:
    """A strictly higher τ_sim replaces the best (ties keep the earlier, less trained checkpoint)."""
    return best is None or tau > best["tau_sim"]


def track_best(t: TrainConfig, tr: Trainer, eval_set: EvalSet, staging: Path, state: dict[str, Any],
               step: int, *, num_steps: int) -> dict[str, Any]:
    """Evaluate after optimizer step `step` (1-based); a new best τ_sim is recorded in the run state
    (checkpointed with it) and, with `train.keep_best`, its weights written to `staging/BEST_FILE`.
    -> the evaluation's fields for the training log."""
    ev = evaluate(tr.draft, eval_set, num_steps)
    state["last_eval"] = {"step": step, "tau_sim": ev["tau_sim"], "tau_sim_decode": ev["tau_sim_decode"]}
    if better(ev["tau_sim"], state.get("best")):
        state["best"] = dict(state["last_eval"])
        if t.keep_best:
            weights = fp32_state(distributed.full_state(tr.draft)[0])   # collective under FSDP
            if tr.world.is_main:
                save_sorted(weights, staging / BEST_FILE)
    return ev


def exported_checkpoint(t: TrainConfig, staging: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Which checkpoint the artifact holds and its τ_sim: the best one with `train.keep_best` (when its
    weights are there), else the last. {} when nothing was evaluated."""
    best, last = state.get("best"), state.get("last_eval")
    if best is None or last is None:
        return {}
    pick = best if t.keep_best and (staging / BEST_FILE).is_file() else last
    return {"tau_sim": pick["tau_sim"], "tau_sim_decode": pick.get("tau_sim_decode"),   # None: an older checkpoint's
            "exported_step": pick["step"], "tau_sim_best": best["tau_sim"],
            "best_step": best["step"], "tau_sim_last": last["tau_sim"]}
