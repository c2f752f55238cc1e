"""F9, measure before scaling: live τ against the offline τ of the same draft.

τ counts the bonus token, so τ = 1 means nothing accepted. Offline τ comes from the reference engine
(verify, or doctor with a target), live τ from a server's finished requests (`steps/lib/metrics.py`).
Offline good + live ≈ 1 means serving is misconfigured, not training: fix the serving rows, do not
retrain. Live ≈ 1 on a freshly started server (serve's smoke test) is the same alarm, earlier.
"""

from __future__ import annotations

from steps.lib.checks.finding import Finding

#: live τ at or below this is "no acceptance" (1.0 = nothing accepted; a little noise above it too).
ZERO_ACCEPTANCE_TAU = 1.1
#: live below this fraction of offline τ is "acceptance quietly lower".
LIVE_OFFLINE_RATIO = 0.8


def check_live_tau(live: float, *, where: str) -> Finding:
    """F9 on a fresh server: live τ above ZERO_ACCEPTANCE_TAU, before anyone benchmarks or promotes it."""
    if live > ZERO_ACCEPTANCE_TAU:
        return Finding("F9", "pass", where, f"live τ {live:.3f} on the smoke prompt")
    return Finding("F9", "fail", where, f"live τ = {live:.3f} on the smoke prompt (≤ {ZERO_ACCEPTANCE_TAU}); a "
                   "draft that passed verify accepting nothing live means serving is misconfigured (F1: EAGLE "
                   "instead of EAGLE3, F4: aux layers)", "compare with the verify artifact's τ; run `eaglenest "
                   "doctor` on the export with --server")


def compare_tau(offline: float | None, live: float | None, earlier: list[Finding], how: str = "") -> Finding:
    """F9: offline good + live ≈ 1 ⇒ serving is misconfigured, not training. `earlier`: the other rows' findings."""
    failing = sorted({f.id for f in earlier if f.status == "fail"})
    rows = (f" (failing checks: {', '.join(failing)})" if failing else "") + (f" [offline: {how}]" if how else "")
    if live is None:
        return Finding("F9", "skip", "", f"no live τ (no --server, or no speculative meta_info); offline τ "
                       f"{'n/a' if offline is None else f'{offline:.3f}'}")
    if live > ZERO_ACCEPTANCE_TAU and (offline is None or live >= LIVE_OFFLINE_RATIO * offline):
        return Finding("F9", "pass", "", f"live τ {live:.3f}"
                       + ("" if offline is None else f", offline τ {offline:.3f}"))
    if offline is None:
        return Finding("F9", "fail", "", f"live τ {live:.3f}: no acceptance{rows}; offline τ not measured",
                       "fix the failing rows above; pass --target to measure offline τ and tell serving from "
                       "training apart")
    if offline > ZERO_ACCEPTANCE_TAU and live <= ZERO_ACCEPTANCE_TAU:
        return Finding("F9", "fail", "", f"offline τ {offline:.3f} (reference engine, same prompts) but live τ "
                       f"{live:.3f}: serving is misconfigured, not training{rows}",
                       "fix the serving rows above (F1 flags, F2 keys, F3 d2t, F4 layers); do not retrain")
    if live <= ZERO_ACCEPTANCE_TAU:
        fix = (f"fix {', '.join(failing)} first: the offline engine loads this directory with the server's own "
               "rules, so a broken checkpoint is broken for both" if failing else
               "the checkpoint serves as written: the draft is undertrained or trained for another target; "
               "check data and training")
        return Finding("F9", "fail", "", f"offline τ {offline:.3f} and live τ {live:.3f}: the draft accepts nothing "
                       f"even offline{rows}", fix)
    return Finding("F9", "warn", "", f"live τ {live:.3f} < {LIVE_OFFLINE_RATIO} × offline τ {offline:.3f}: "
                   "acceptance quietly lower", "check F4 (captured layers) and the serving flags")


#: offline and live τ this close measure the same draft the same way: the serving adds nothing wrong
SAME_TAU = 0.1


def read_no_acceptance(live: float | None, offline: float | None, failing: list[str], *,
                       answers: int | None = None, needed: int | None = None) -> str:
    """A zero-acceptance verdict read as a diagnosis: what offline against live τ and the doctor's rows say
    together (`failing`: the rows that failed; `answers`/`needed`: the data the draft learned from and what its
    config needs, steps/lib/data/size.py)."""
    if failing:
        rows = ", ".join(failing)
        return f"the doctor names {rows}: the checkpoint or the server is wrong, not the training — fix {rows} first"
    if live is None:
        return "the server reported no speculative decoding counters: it ran without the draft (check its flags)"
    if offline is None:
        return (f"live τ {live:.2f} and offline τ not measured: serving and training cannot be told apart — "
                "run verify on the export")
    if offline > ZERO_ACCEPTANCE_TAU and offline - live > SAME_TAU:
        return (f"offline τ {offline:.2f} but live τ {live:.2f}, and no doctor row fails: the draft is good and the "
                "serving loses it (F9) — compare the server's command with `eaglenest serve --print-command`")
    same = "≈" if abs(offline - live) <= SAME_TAU else "and"
    data = f" from {answers} answers (its config needs ~{needed})" if answers is not None and needed else ""
    return (f"offline τ {offline:.2f} {same} live τ {live:.2f} and every doctor check passes: the serving is right, "
            f"the draft learned too little{data} — add data (more prompts, datagen.samples_per_prompt) or train "
            "longer (train.epochs)")
