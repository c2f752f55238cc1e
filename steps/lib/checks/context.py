"""F5, the draft's context: `max_position_embeddings` shorter than the context the target is served with.

SGLang gives the draft the target's context length and refuses to start when the draft's
`max_position_embeddings` is shorter (sglang.md §1.8), unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN
hides it and acceptance degrades past the trained length. Export sets it from the target.
"""

from __future__ import annotations

from steps.lib.checks.finding import Finding

#: the environment override that lets SGLang start with a too-short draft context.
LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


def check_context(draft_mpe: object, serving: object, *, where: str, overridden: bool = False) -> Finding:
    """F5: the draft's `max_position_embeddings` against the serving context (`--context-length` or the
    target's). `overridden`: the server's environment sets LONGER_CONTEXT_ENV (a warning, not a pass)."""
    if serving is None:
        return Finding("F5", "skip", where, f"max_position_embeddings={draft_mpe!r}; no serving context to compare "
                       "(pass the target or --context-length)")
    if isinstance(draft_mpe, int) and not isinstance(draft_mpe, bool) and draft_mpe >= int(serving):
        return Finding("F5", "pass", where, f"max_position_embeddings={draft_mpe} ≥ serving context {serving}")
    fix = (f"re-export the draft with target.context_length={serving} (steps.export sets it from the target), "
           f"or serve with --context-length {draft_mpe}, or set {LONGER_CONTEXT_ENV}=1")
    if overridden:
        return Finding("F5", "warn", where, f"max_position_embeddings={draft_mpe!r} < serving context length "
                       f"{serving} ({LONGER_CONTEXT_ENV}=1 overrides it; acceptance degrades past the trained "
                       "length)", fix)
    return Finding("F5", "fail", where, f"max_position_embeddings={draft_mpe!r} < serving context length {serving}: "
                   f"SGLang refuses to start (or {LONGER_CONTEXT_ENV} hides it)", fix)
