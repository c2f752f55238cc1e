"""`train.epochs: auto`: epochs from the data's size by the documented rule (steps/lib/training/plan.py)."""

from __future__ import annotations

import pytest

from steps.lib.config import parse_config
from steps.lib.training.plan import AUTO_EPOCH_TOKENS, auto_epochs, build_plan


def test_auto_epochs_trains_the_token_budget_within_two_to_twelve_passes():
    assert auto_epochs(AUTO_EPOCH_TOKENS // 4) == pytest.approx(4.0)
    assert auto_epochs(1_920_000) == pytest.approx(12.0)       # issue 23's curve: still rising at 12
    assert auto_epochs(45_000) == 12.0                          # the demo's data: capped
    assert auto_epochs(200_000_000) == 2.0                      # ~500k samples: peers' 2–3 epochs
    assert auto_epochs(0) == 12.0


def test_epochs_auto_is_accepted_and_a_number_stays_the_default():
    cfg = parse_config({"name": "t", "target": {"source": "tiny"}, "train": {"epochs": "auto"}})
    assert cfg.train.epochs == "auto"
    assert parse_config({"name": "t", "target": {"source": "tiny"}}).train.epochs == 1.0
    with pytest.raises(ValueError):
        parse_config({"name": "t", "target": {"source": "tiny"}, "train": {"epochs": "many"}})


def test_auto_epochs_plans_that_many_passes():
    lengths = {"a": [100] * 40}
    plan = build_plan(lengths, epochs=auto_epochs(AUTO_EPOCH_TOKENS // 4), seed=0, max_length=100,
                      rows_per_batch=1)
    assert len(plan) == 4 * 40
