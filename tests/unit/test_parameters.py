"""flows/parameters.py: every flow parameter described for the Run form, and a pipeline's parameters checked
before any step runs (one line naming the parameter, the file or field, and the fix).

The deployment run of a typo'd parameter against a real server: tests/integration/test_orchestration.py.
"""

from __future__ import annotations

import logging

import pytest
from prefect.logging import disable_run_logger
from prefect.utilities.callables import parameter_schema

from flows.parameters import BadParameter, Outcome, QuietOutcomes, check_pipeline

GOOD = {"config": "tiny", "overrides": [], "store": None, "mode": "deployments", "pool": "local",
        "spec_url": None, "baseline_url": None, "through": "gate"}


def every_flow():
    import flows.dataset_trigger as trigger
    import flows.pipeline as pipeline
    import flows.promotion as promotion
    import flows.step_flows as step_flows
    from steps.registry import STEPS

    return [pipeline.eagle3_pipeline, promotion.rollback_flow, trigger.dataset_sensor,
            *(step_flows.flow_of(s) for s in STEPS)]


@pytest.mark.parametrize("flow", every_flow(), ids=lambda f: f.name)
def test_every_parameter_of_every_deployed_flow_has_a_description(flow):
    properties = parameter_schema(flow).model_dump()["properties"]
    assert properties and all(p.get("description") for p in properties.values()), \
        [name for name, p in properties.items() if not p.get("description")]


def check(tmp_path, **changes):
    return check_pipeline(**{**GOOD, "store": f"file://{tmp_path / 'store'}", **changes})


@pytest.mark.parametrize("changes, name, says", [
    ({"config": "tiniy"}, "config", ["tiniy.yaml: config file not found", "tiny", "smollm2-135m", "-p config=NAME"]),
    ({"overrides": ["train.lrr=3e-4"]}, "overrides", ["tiny.yaml", "train.lrr: unknown field", "-p overrides="]),
    ({"overrides": ["train.lr=-1"]}, "overrides", ["train.lr", "-p overrides="]),
    ({"store": "ftp://host/x"}, "store", ["ftp://host/x", "-p store=file:///abs/path"]),
    ({"spec_url": "127.0.0.1:30000"}, "spec_url", ["not a server address", "http://HOST:PORT"]),
    ({"pool": "gpu"}, "pool", ["'gpu' is not one of local, docker, k8s", "-p pool=local"]),
])
def test_a_bad_parameter_is_one_line_naming_it_the_problem_and_the_fix(tmp_path, changes, name, says):
    with pytest.raises(BadParameter) as caught:
        check(tmp_path, **changes)
    line = str(caught.value)
    assert caught.value.name == name and line.startswith(f"parameter {name}: ") and "\n" not in line, line
    for fragment in says:
        assert fragment in line, (fragment, line)


def test_good_parameters_give_the_config_and_the_absolute_store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, store = check_pipeline(**{**GOOD, "store": "rel/store"})    # a plain relative path is a folder
    assert cfg.name == "tiny" and store == f"file://{(tmp_path / 'rel/store').resolve()}"


def test_the_pipeline_refuses_a_typo_before_any_step_with_its_one_line_as_the_failed_message(tmp_path):
    from flows.pipeline import eagle3_pipeline

    with disable_run_logger():
        state = eagle3_pipeline.fn(config="configs/tiny.yaml", overrides=["train.lrr=3e-4"],
                                   store=f"file://{tmp_path / 'store'}")
    assert state.is_failed() and state.message.startswith("parameter overrides: ")
    assert isinstance(state.data, Outcome)
    assert not (tmp_path / "store" / "artifacts").exists()      # no step ran


def test_eaglenest_pipeline_prints_a_refused_parameter_as_one_line_and_exits_2(capsys):
    from flows import pipeline_cli

    assert pipeline_cli.main(["--config", "tiniy"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("eaglenest pipeline: parameter config: ") and "Traceback" not in "\n".join(err), err


def test_an_outcome_reaching_the_engine_logs_no_traceback():
    """What Prefect logs when it reads a Failed state's result at the end of a run: dropped for an Outcome (the
    state message says it), kept for any other exception."""
    def record(exc: BaseException) -> logging.LogRecord:
        return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1,
                                 "Engine execution exited with unexpected exception", None, (type(exc), exc, None))

    assert not QuietOutcomes().filter(record(Outcome("zero acceptance")))
    assert QuietOutcomes().filter(record(RuntimeError("a bug")))


def test_a_dataset_that_is_not_in_the_store_is_refused_naming_it(tmp_path):
    from flows.dataset_trigger import upload_dataset
    from flows.parameters import check_dataset
    from flows.pipeline import dataset_overrides
    from steps.lib.store import open_store

    store = open_store(f"file://{tmp_path / 'store'}")
    (tmp_path / "chats.jsonl").write_text('{"prompt": "hi?"}\n')
    record, _ = upload_dataset(store, tmp_path / "chats.jsonl", "support")
    assert check_dataset(record["uri"], "tiny", dataset_overrides(record["uri"])).dataset.sources[0].path \
        == record["uri"]
    missing = record["uri"].replace("/support/", "/typo/")
    with pytest.raises(BadParameter, match=r"^parameter dataset: .*/typo/chats.jsonl: no such object in the store"):
        check_dataset(missing, "tiny", dataset_overrides(missing))
