"""How flows/pipeline.py runs stages: retries (run_stage: a transient failure is retried, an error a
rerun would repeat (bad input, a missing model) fails on its first try, and the error names its
stage) and the settings of an in-process run (local_run_settings)."""

from __future__ import annotations

import logging

import pytest
from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

from flows.pipeline import local_run_settings, run_stage
from moplex_core.lm.loading import ModelUnavailableError
from moplex_core.schema import RowIssue, SchemaError

LOGGER = logging.getLogger("test-stage-retries")


class Flaky:
    """A stage that raises each of ``errors`` in turn, then returns "done"; counts its calls."""

    def __init__(self, *errors: Exception) -> None:
        self.errors, self.calls = list(errors), 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


def test_a_transient_failure_is_retried_and_logged(caplog):
    stage = Flaky(OSError("NFS server not responding"))
    with caplog.at_level(logging.WARNING, logger=LOGGER.name):
        result = run_stage("cache", stage, retries=2, delay_seconds=0, logger=LOGGER)
    assert result == "done"
    assert stage.calls == 2
    assert "the cache stage failed (OSError: NFS server not responding); retry 1 of 2" in caplog.text


def test_retries_run_out_and_the_last_error_names_the_stage():
    stage = Flaky(RuntimeError("CUDA error: an illegal memory access"), RuntimeError("again"))
    with pytest.raises(RuntimeError, match="again") as error:
        run_stage("train", stage, retries=1, delay_seconds=0, logger=LOGGER)
    assert stage.calls == 2
    assert error.value.__notes__ == ["moplex pipeline stage: train"]


@pytest.mark.parametrize("error", [
    SchemaError([RowIssue(1, "bad-1", "ranking", "index 7 is out of range", "rankings.jsonl line 2")]),
    ValueError("train.k = 40 clusters, but the cache has only 12 training ranking(s)"),
    ModelUnavailableError("model path 'no-such-model' does not exist"),
])
def test_an_error_a_rerun_repeats_is_not_retried(error, caplog):
    stage = Flaky(error)
    with caplog.at_level(logging.WARNING, logger=LOGGER.name), pytest.raises(type(error)) as raised:
        run_stage("ingest", stage, retries=3, delay_seconds=0, logger=LOGGER)
    assert stage.calls == 1
    assert raised.value.__notes__ == ["moplex pipeline stage: ingest"]
    assert "retry" not in caplog.text


def test_an_in_process_run_on_a_temporary_server_sends_no_heartbeats_and_one_on_a_real_server_does():
    # Prefect's default (180 s), set here: the session's Prefect fixture runs without heartbeats.
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 180}):
        with temporary_settings(updates={PREFECT_API_URL: None}), local_run_settings():
            assert PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() is None
        with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api"}), local_run_settings():
            assert PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() == 180
        assert PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() == 180
