"""steps/lib/runtime/progress.py: a step's progress reaches listeners (the Prefect UI), throttled, never failing it."""

from __future__ import annotations

from steps.lib.runtime import progress


def test_listeners_get_start_throttled_updates_and_the_end():
    calls: list[progress.Update] = []
    with progress.listening(calls.append):
        with progress.bar(total=100, desc="extract", unit="tok", disable=True) as bar:
            for _ in range(100):
                bar.update(1)       # 100 updates within the 2 s throttle window
    as_tuple = [(u.desc, u.done, u.total, u.unit) for u in calls]
    assert as_tuple[0] == ("extract", 0.0, 100.0, "tok")
    assert as_tuple[-1] == ("extract", 100.0, 100.0, "tok")
    assert len(calls) <= 4, calls   # start, reaching the total, close (+ at most one timed update)


def test_a_failing_listener_does_not_fail_the_step_and_is_removed_after_the_block(capsys):
    def broken(*_):
        raise RuntimeError("UI down")

    with progress.listening(broken):
        with progress.bar(total=2, desc="train", disable=True) as bar:
            bar.update(2)
    assert "progress listener failed: UI down" in capsys.readouterr().err
    assert broken not in progress._listeners


def test_updates_carry_the_postfix_elapsed_time_and_an_eta_that_ignores_resumed_work():
    calls: list[progress.Update] = []
    with progress.listening(calls.append):
        with progress.bar(total=10, desc="train", unit="step", initial=4, disable=True) as bar:
            bar.update(1)
            bar.set_postfix(loss="2.345", acc0=0.123456789)
    last = calls[-1]
    assert last.postfix == {"loss": "2.345", "acc0": 0.123456789} and last.initial == 4.0 and last.done == 5.0
    assert last.elapsed_s > 0
    # 1 step in elapsed_s seconds, 5 left: the 4 resumed steps must not make it look faster
    assert abs(last.eta_s - 5 * last.elapsed_s) < 1e-6
    assert last.line().startswith("train: 5/10 step (50%), 0:00 elapsed, ETA 0:00")
    assert last.line().endswith(", loss=2.345, acc0=0.123")


def test_eta_is_unknown_before_any_work_and_clock_formats_hours():
    assert progress.Update("x", 0, 10, "it", elapsed_s=3.0).eta_s is None
    assert progress.Update("x", 5, 10, "it", elapsed_s=10.0).eta_s == 10.0
    assert progress.clock(3723) == "1:02:03" and progress.clock(62) == "1:02"


def test_a_note_reaches_listeners_at_once_and_stays_on_later_updates():
    updates: list[progress.Update] = []
    with progress.listening(updates.append):
        with progress.bar(total=10, desc="train", unit="step", disable=True) as bar:
            bar.update(1)
            bar.set_note(tau_sim=1.5, best="1.500 @ step 1")     # not throttled: a new τ is news
            bar.update(1)
            bar.set_postfix(loss="2.000")
            bar.update(8)
    noted = [u for u in updates if u.done == 1.0 and "tau_sim" in u.postfix]
    assert noted and noted[0].postfix_items() == [("tau_sim", "1.500"), ("best", "1.500 @ step 1")]
    assert updates[-1].postfix == {"loss": "2.000", "tau_sim": 1.5, "best": "1.500 @ step 1"}
    assert "tau_sim=1.500" in updates[-1].line()


def test_an_update_crosses_a_process_boundary_as_one_line_and_other_lines_are_not_updates(capsys):
    update = progress.Update("train", 45, 100, "step", elapsed_s=12.0, initial=5, postfix={"loss": 2.345})
    progress.write_line(update)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(progress.PREFIX)
    assert progress.parse_line(line) == update
    assert progress.parse_line("train: 45/100 step (45%)") is None
    assert progress.parse_line(progress.PREFIX + "{not json") is None


def test_the_step_cli_writes_progress_lines_only_when_an_orchestrator_asks(monkeypatch):
    monkeypatch.setattr(progress, "_listeners", [])
    progress.install_from_environment()
    assert progress._listeners == []
    monkeypatch.setenv(progress.LINES_ENV, "1")
    progress.install_from_environment()
    progress.install_from_environment()
    assert progress._listeners == [progress.write_line]
