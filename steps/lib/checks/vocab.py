"""F3, the vocab map: `d2t` stored as absolute target ids instead of offsets, missing, or float.

The server maps draft id i to target id `i + d2t[i]`; any of those faults maps drafts to the wrong
target tokens and acceptance is ≈1 with no error. `validate_vocab` is the rule (mapping builds with
it, every reader re-checks with it); `vocab_problem` is the same rule on whatever a checkpoint holds
(t2d is optional there: SGLang and vLLM never read it); `check_vocab` is the catalogue row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from steps.lib.checks.finding import Finding

if TYPE_CHECKING:
    from torch import Tensor

# torch is imported where a tensor is read: the orchestrator imports these checks (through steps.lib.artifacts)
# for names and sizes only.

#: what fixes a broken map: it is built in one place.
FIX = ("store d2t as int64 offsets d2t = ids - arange(draft_vocab) with ids the sorted target ids of the draft "
       "vocab (steps.mapping.build_vocab)")


def validate_vocab(d2t: Tensor | None, t2d: Tensor | None, target_vocab: int) -> None:
    """Raise ValueError naming the F3 fault: missing, non-int64, absolute ids, out of range,
    unsorted, or a t2d that disagrees with d2t."""
    import torch

    if d2t is None or t2d is None:
        raise ValueError(f"vocab map is missing ({'d2t' if d2t is None else 't2d'} is None); a draft with "
                         "a reduced vocab cannot be served without d2t (F3)")
    if d2t.dtype != torch.int64:
        raise ValueError(f"d2t has dtype {d2t.dtype}, expected int64 offsets (target = i + d2t[i]); a float "
                         "or int32 map makes the server map draft ids to the wrong target tokens (F3)")
    if t2d.dtype != torch.bool or t2d.ndim != 1 or t2d.numel() != target_vocab:
        raise ValueError(f"t2d must be bool [{target_vocab}], got {t2d.dtype} {list(t2d.shape)}")
    if d2t.ndim != 1 or not 0 < d2t.numel() <= target_vocab:
        raise ValueError(f"d2t must be 1-D with 1..{target_vocab} entries, got shape {list(d2t.shape)}")
    target = torch.arange(d2t.numel()) + d2t
    out = ((target < 0) | (target >= target_vocab)).nonzero().flatten()
    if len(out):
        i = int(out[0])
        raise ValueError(f"d2t[{i}]={int(d2t[i])} maps draft id {i} to target id {int(target[i])}, outside "
                         f"[0, {target_vocab}); {len(out)} such ids. If d2t holds absolute target ids, store "
                         "offsets instead: d2t = ids - arange(draft_vocab) (F3)")
    if len(target) > 1 and not bool((target[1:] > target[:-1]).all()):
        raise ValueError("i + d2t[i] is not strictly increasing: the draft vocab must be sorted ascending by "
                         "target id (d2t looks like absolute ids, a frequency-ordered map or has duplicates; F3)")
    if len(d2t) > 1 and torch.equal(t2d.nonzero().flatten(), d2t):
        raise ValueError("d2t holds absolute target ids (d2t == t2d.nonzero()), expected offsets "
                         "target = i + d2t[i]; store d2t = ids - arange(draft_vocab) (F3)")
    if not torch.equal(t2d.nonzero().flatten(), target):
        raise ValueError(f"t2d.nonzero() != arange + d2t: t2d marks {int(t2d.sum())} ids, d2t maps "
                         f"{len(target)}; the two halves of the vocab map disagree (F3)")


def vocab_problem(d2t: Tensor, t2d: Tensor | None, draft_vocab: int, vocab: int) -> str | None:
    """What is wrong with a checkpoint's d2t (and t2d when it has a usable one), or None."""
    import torch

    if d2t.dtype != torch.int64:
        return f"dtype {d2t.dtype}, expected int64 (a float map cannot index and loses ids above 256)"
    if tuple(d2t.shape) != (draft_vocab,):
        return f"shape {list(d2t.shape)}, expected [{draft_vocab}] (draft_vocab_size)"
    ids = torch.arange(draft_vocab) + d2t
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        return (f"i + d2t[i] spans [{int(ids.min())}, {int(ids.max())}], outside [0, {vocab}): absolute target "
                "ids stored instead of offsets")
    if t2d is not None and t2d.dtype == torch.bool and t2d.numel() == vocab:
        try:
            validate_vocab(d2t, t2d, vocab)
        except ValueError as err:
            return str(err)
    elif len(torch.unique(ids)) != draft_vocab:
        return "i + d2t[i] repeats target ids: not a valid offset map"
    return None


def check_vocab(d2t: Tensor | None, t2d: Tensor | None, *, draft_vocab: object, vocab: object,
                target_vocab: int | None, where: str, weights_where: str) -> Finding:
    """F3 on a checkpoint: vocab sizes against the target, d2t present when needed, and a valid map."""
    if target_vocab is not None and vocab != target_vocab:
        return Finding("F3", "fail", where, f"vocab_size={vocab!r} but the target's is {target_vocab}",
                       "vocab_size must be the target's vocab (embed_tokens is the target's)")
    if not isinstance(draft_vocab, int) or not isinstance(vocab, int):
        return Finding("F3", "skip", where, f"draft_vocab_size={draft_vocab!r}, vocab_size={vocab!r} (see F7); "
                       "vocab map not checked")
    if d2t is None:
        if draft_vocab < vocab:
            return Finding("F3", "fail", where, f"draft_vocab_size {draft_vocab} < vocab_size {vocab} and no d2t: "
                           "the server uses draft ids as target ids (garbage drafts, τ ≈ 1)",
                           "add d2t (int64 offsets, target_id = i + d2t[i]) from the training vocab map")
        return Finding("F3", "pass", where, "full-vocab draft, no d2t needed")
    problem = vocab_problem(d2t, t2d, draft_vocab, vocab)
    if problem:
        return Finding("F3", "fail", f"{weights_where}:d2t", problem, FIX)
    return Finding("F3", "pass", where, f"d2t int64 offsets for {draft_vocab} draft ids, in [0, {vocab})"
                   + (", consistent with t2d" if t2d is not None else " (no t2d: training-only, fine)"))


def check_vocab_size(vocab: object, target_vocab: object, *, where: str) -> list[Finding]:
    """F3 in a config: the draft's vocab_size is the target's (its embedding and d2t's range are the target's)."""
    if not isinstance(target_vocab, int) or vocab == target_vocab:
        return []
    return [Finding("F3", "fail", f"{where}:vocab_size", f"expected {target_vocab} (the target's vocab_size), got "
                    f"{vocab!r}", "vocab_size must be the target's vocab (embed_tokens is the target's)")]


def vocab_findings(d2t: Tensor | None, t2d: Tensor | None, *, draft_vocab: int | None, vocab: int | None,
                   target_vocab: int | None, where: str, config_where: str, d2t_key: str, t2d_key: str
                   ) -> list[Finding]:
    """F3 for the strict checker: vocab_size is the target's, d2t present when the vocab is reduced (or the
    config is unreadable), t2d bool over the target vocab, and d2t a valid offset map."""
    import torch

    out = check_vocab_size(vocab, target_vocab, where=config_where)
    sizes_known = isinstance(draft_vocab, int) and isinstance(vocab, int)
    if d2t is None:
        if not sizes_known or draft_vocab < vocab:
            out.append(Finding("F3", "fail", f"{where}:{d2t_key}", "missing: the engine uses draft ids as target ids "
                               "without an error", FIX))
        return out
    t2d_usable = t2d is not None and t2d.dtype == torch.bool and sizes_known and tuple(t2d.shape) == (vocab,)
    if t2d is not None and not t2d_usable and sizes_known:
        out.append(Finding("F3", "fail", f"{where}:{t2d_key}", f"{t2d.dtype} {list(t2d.shape)}, expected bool "
                           f"[{vocab}] (the target vocab)", FIX))
    if sizes_known:
        problem = vocab_problem(d2t, t2d if t2d_usable else None, draft_vocab, vocab)
        if problem:
            out.append(Finding("F3", "fail", f"{where}:{d2t_key}", problem, FIX))
    return out
