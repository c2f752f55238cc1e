"""steps/progress.py: a step's progress reaches listeners (the Prefect UI) throttled, and never fails the step."""

from __future__ import annotations

from steps import progress


def test_listeners_get_start_throttled_updates_and_the_end():
    calls: list[tuple[str, float, float, str, str]] = []
    with progress.listening(lambda *a: calls.append(a)):
        with progress.bar(total=100, desc="extract", unit="tok", disable=True) as bar:
            for _ in range(100):
                bar.update(1)       # 100 updates within the 2 s throttle window
    assert calls[0] == ("extract", 0.0, 100.0, "tok", "")
    assert calls[-1] == ("extract", 100.0, 100.0, "tok", "")
    assert len(calls) <= 4, calls   # start, reaching the total, close (+ at most one timed update)


def test_a_failing_listener_does_not_fail_the_step_and_is_removed_after_the_block(capsys):
    def broken(*_):
        raise RuntimeError("UI down")

    with progress.listening(broken):
        with progress.bar(total=2, desc="train", disable=True) as bar:
            bar.update(2)
    assert "progress listener failed: UI down" in capsys.readouterr().err
    assert broken not in progress._listeners


def test_a_note_reaches_listeners_at_once_and_stays_on_later_updates():
    calls: list[tuple] = []
    with progress.listening(lambda *a: calls.append(a)):
        with progress.bar(total=10, desc="train", unit="step", disable=True) as bar:
            bar.update(1)
            bar.set_note("tau_sim 1.500 (best 1.500 @ step 1)")   # not throttled: a new τ is news
            bar.update(9)
    assert ("train", 1.0, 10.0, "step", "tau_sim 1.500 (best 1.500 @ step 1)") in calls
    assert calls[-1] == ("train", 10.0, 10.0, "step", "tau_sim 1.500 (best 1.500 @ step 1)")
