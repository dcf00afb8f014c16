"""A measuring callback's result reaches the sweeper through the job's run directory, whatever the
app's task returns (gpuopt.core.measured_job, gpuopt.sweeper.launchers.trial_task.own_rank)."""

from __future__ import annotations

import math

import pytest

from gpuopt.core import measured_job
from gpuopt.core.result import Metrics, Status, TrialResult, result_user_attrs
from gpuopt.sweeper.launchers.trial_task import own_rank
from gpuopt.sweeper.objectives import outcome_from_return


@pytest.mark.parametrize(
    ("returned", "kept"),
    [
        (0.25, {"value": 0.25}),
        (3, {"value": 3.0}),
        ({"val/acc": 0.9, "tags": ["a"], "best": True}, {"val/acc": 0.9, "best": True}),
        (None, None),
        (True, None),  # a bool is not a metric
        (math.nan, None),
        ("done", None),
    ],
)
def test_what_the_app_returned_is_kept_beside_the_result(returned, kept):
    result = measured_job.with_app_return(TrialResult(Status.OK), returned)
    assert result.app_return == kept


def _measured(throughput: float) -> TrialResult:
    return TrialResult(Status.OK, Metrics(throughput=throughput, global_batch=128))


def test_the_callbacks_result_is_the_trials_whatever_the_task_returns(tmp_path):
    ranks = tmp_path / "ranks"

    def ends_the_job(cfg):
        measured_job.write(_measured(1000.0), tmp_path)
        raise measured_job.TrialMeasured("measured")

    ended = own_rank(ends_the_job, None, ranks)
    assert isinstance(ended, TrialResult) and ended.metrics.throughput == 1000.0
    assert ended.app_return is None

    returned = own_rank(lambda cfg: 0.7, None, ranks)  # the same run dir's file, a float returned
    assert returned.metrics.throughput == 1000.0 and returned.app_return == {"value": 0.7}
    attrs = result_user_attrs(returned)
    assert attrs["app.value"] == 0.7 and attrs["throughput"] == 1000.0
    # Saved and read back, as the trial process hands it to the sweeper.
    assert TrialResult.from_dict(returned.to_dict()).app_return == {"value": 0.7}


def test_without_a_measuring_callback_the_tasks_return_is_the_trials(tmp_path):
    assert own_rank(lambda cfg: 0.7, None, tmp_path / "ranks") == 0.7


def test_the_job_ends_past_an_apps_own_except_exception():
    def app():
        try:
            raise measured_job.TrialMeasured("measured")
        except Exception:  # lightning-hydra-template's task_wrapper
            return "swallowed"

    with pytest.raises(measured_job.TrialMeasured):
        app()


def test_an_app_that_returns_nothing_is_told_how_to_be_measured():
    outcome = outcome_from_return(None, ["value"], ["maximize"])
    assert outcome.failed and "gpuopt.MeasureCallback" in outcome.user_attrs["reason"]


def test_a_task_that_returns_gpuopts_result_itself_keeps_it(tmp_path):
    """The stock contract: a dict naming gpuopt's metrics (its own names kept as they are)."""
    measured_job.write(_measured(1000.0), tmp_path)
    named = {"throughput": 900.0, "my_batch_size": 64}
    assert own_rank(lambda cfg: named, None, tmp_path / "ranks") == named
    own = _measured(800.0)
    assert own_rank(lambda cfg: own, None, tmp_path / "ranks") is own


def test_another_launchers_job_is_read_from_its_run_directory_too(tmp_path):
    """hydra/launcher=basic runs the job in the sweep's process, without gpuopt's trial task."""
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from gpuopt.sweeper.record import outcome_of

    measured_job.write(_measured(1000.0), tmp_path)
    ret = JobReturn(status=JobStatus.COMPLETED)
    ret.return_value = 0.0
    ret.hydra_cfg = OmegaConf.create({"hydra": {"runtime": {"output_dir": str(tmp_path)}}})
    outcome = outcome_of(ret, ["throughput"], ["maximize"])
    assert outcome.values == [1000.0] and outcome.user_attrs["app.value"] == 0.0
