"""gpuopt.MeasureJob: any Hydra app's own loop measured from torch's optimizer hooks and its
DataLoader iterators (gpuopt.engines.job_meter), with no change to its code; a plain loop swept with
the callback in YAML alone (pytorch/examples' mnist/main.py, the real file)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.dataloader import _BaseDataLoaderIter

from gpuopt.core.checks import measure_conf
from gpuopt.core.result import Status
from gpuopt.engines.job_meter import JobMeter

SHORT = {"warmup_steps": 1, "min_steps": 3, "max_steps": 6, "time_budget_s": 1.0,
         "min_time_s": 0.0, "nvml_interval_s": 0.1}  # fmt: skip
HELPERS = Path(__file__).parent / "helpers"
MNIST_MAIN = Path(__file__).parent / "third_party" / "pytorch_examples_mnist" / "main.py"


def _loader(samples: int, batch: int) -> DataLoader:
    data = TensorDataset(torch.randn(samples, 12), torch.randint(0, 3, (samples,)))
    return DataLoader(data, batch_size=batch, shuffle=True)


def _train(epochs: int, batch: int = 8, test_every: int = 2, accumulate: int = 1) -> None:
    """A plain loop as users write it, with a test loader iterated inside the epoch."""
    model = torch.nn.Linear(12, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    train, test = _loader(64, batch), _loader(40, 20)
    for _ in range(epochs):
        for step, (x, y) in enumerate(train):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if (step + 1) % accumulate:
                continue
            optimizer.step()
            optimizer.zero_grad()
            if step % test_every == 0:
                with torch.no_grad():
                    for x_test, _ in test:
                        model(x_test)


@pytest.fixture
def meter():
    original = _BaseDataLoaderIter.__next__
    job = JobMeter(measure_conf(SHORT))
    job.install()
    yield job
    job.uninstall()
    assert _BaseDataLoaderIter.__next__ is original  # nothing stays hooked


def test_a_plain_loop_is_measured_and_the_job_ends_past_its_except_exception(meter):
    with pytest.raises(SystemExit) as ended:
        try:
            _train(epochs=20)
        except Exception:  # the app's own handler does not swallow the end of the job
            pytest.fail("the end of the job was swallowed")
    assert ended.value.code == 0
    result = meter.result
    assert result.status is Status.OK, result.reason
    m = result.metrics
    # The test loader's batches of 20 feed no optimizer step: 8 samples a step, the loop's batch.
    assert m.global_batch == 8 and m.micro_batch == 8 and m.accumulation_steps == 1
    # What the training loader was made with, for the search space found (not the test loader's).
    observed = result.config["observed"]
    assert observed["batch_size"] == 8 and observed["num_workers"] == 0
    assert m.lr == 0.05
    assert m.throughput > 0 and m.timed_steps >= SHORT["min_steps"]
    # Linear(12, 3), counted on the first step: the forward and the weights' gradient matmuls
    # (the input needs no gradient), 2 x 12 x 3 FLOPs each per sample.
    assert m.flops_per_sample == 2 * (2 * 12 * 3)
    # Unhooked before the job ended: another optimizer step counts nothing.
    steps = meter.optimizer_steps
    _train(epochs=1)
    assert meter.optimizer_steps == steps


def test_accumulated_micro_batches_make_one_optimizer_steps_global_batch(meter):
    with pytest.raises(SystemExit):
        _train(epochs=20, accumulate=2)
    m = meter.result.metrics
    assert (m.micro_batch, m.accumulation_steps, m.global_batch) == (8, 2, 16)


@pytest.mark.parametrize(
    ("job", "why"),
    [
        (lambda: None, "never iterated a DataLoader"),
        (lambda: list(_loader(16, 8)), "never stepped a torch.optim optimizer"),
        (lambda: _train(epochs=1, batch=32), "ended after 2 optimizer steps, before the timed"),
    ],
)
def test_a_job_that_ends_unmeasured_gets_a_clear_status(meter, job, why):
    job()
    result = meter.unmeasured()
    assert result.status is Status.ERROR and why in result.reason
    assert meter.unmeasured() is None or meter.unmeasured() is result  # said once


@pytest.mark.slow  # imports Lightning
def test_a_lightning_fit_is_measured_without_gpuopts_lightning_callback(meter):
    """MeasureJob alone (no gpuopt.MeasureCallback in the Trainer): Lightning's own loop, seen
    through torch's optimizer hook and the DataLoader iterator it makes."""
    import lightning as L

    from tests.helpers.lightning_models import TinyClassifier

    trainer = L.Trainer(accelerator="cpu", max_epochs=100, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    with pytest.raises(SystemExit):  # the job ends once measured, past Lightning's handlers
        trainer.fit(TinyClassifier(lr=0.02, batch_size=16))
    result = meter.result
    assert result.status is Status.OK, result.reason
    m = result.metrics
    assert (m.global_batch, m.micro_batch, m.accumulation_steps, m.lr) == (16, 16, 1, 0.02)
    # Linear(16, 32) and Linear(32, 4): forward and weight-gradient matmuls, plus the second
    # layer's input gradient, per sample.
    assert m.flops_per_sample == 2 * (16 * 32 + 32 * 4) * 2 + 2 * 32 * 4
    assert m.timed_steps >= SHORT["min_steps"] and m.throughput > 0


@pytest.mark.slow  # imports transformers
def test_the_hf_trainer_is_measured_without_gpuopts_hf_callback(meter, tmp_path):
    """MeasureJob alone under the Hugging Face Trainer: its accelerate-wrapped DataLoader and
    optimizer are torch's underneath; accumulation gives the global batch."""
    transformers = pytest.importorskip("transformers")

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4096

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=128,
                                     n_positions=16)  # fmt: skip
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-4, max_steps=400, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    with pytest.raises(SystemExit):
        trainer.train()
    result = meter.result
    assert result.status is Status.OK, result.reason
    m = result.metrics
    assert (m.micro_batch, m.accumulation_steps, m.global_batch) == (4, 2, 8)
    assert m.lr == pytest.approx(3e-4) and m.flops_per_sample > 0
    assert result.config["observed"]["batch_size"] == 4


def _until(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_job_that_does_not_step_within_its_budget_gets_its_status_and_ends():
    """budget_s after the job's start with no optimizer step: "not measured" with the reason, and
    the process ends (here a stand-in records the exit); a job that steps in time is not ended."""
    stuck = JobMeter(measure_conf(SHORT), budget_s=0.2)
    ended: list[int] = []
    stuck.end_process = ended.append
    stuck.install()
    try:
        list(_loader(16, 8))  # it fetches, but never steps an optimizer
        assert _until(lambda: ended == [1])
    finally:
        stuck.uninstall()
    assert stuck.result.status is Status.ERROR
    assert stuck.result.reason.startswith("not measured: no optimizer step within budget_s=0.2 s")
    assert " DataLoader batches fetched); a job that trains later" in stuck.result.reason

    training = JobMeter(measure_conf(SHORT), budget_s=0.2)
    training.end_process = ended.append
    training.install()
    try:
        with pytest.raises(SystemExit):
            _train(epochs=20)  # its first step cancels the budget; the window then ends the job
        time.sleep(0.4)
    finally:
        training.uninstall()
    assert ended == [1] and training.result.status is Status.OK


@pytest.mark.parametrize("bad", [0, -1, "soon", True])
def test_a_bad_budget_is_one_config_error_naming_the_key(bad):
    from gpuopt import MeasureJob
    from gpuopt.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"hydra\.callbacks\.gpuopt_measure\.budget_s"):
        MeasureJob(budget_s=bad)


STUCK_APP = """
import time

import hydra
import torch


@hydra.main(version_base=None, config_path="conf", config_name="config")
def run(cfg):
    data = torch.utils.data.TensorDataset(torch.randn(64, 4))
    while True:  # stuck before its training: it never steps an optimizer
        for _ in torch.utils.data.DataLoader(data, batch_size=cfg.batch_size):
            time.sleep(0.05)


if __name__ == "__main__":
    run()
"""


@pytest.mark.slow
def test_a_sweeps_trial_that_never_steps_ends_at_measure_jobs_budget_with_its_status(tmp_path):
    """The trial's process ends at MeasureJob's budget_s, not at the launcher's timeout, and the
    trial's reason is MeasureJob's; no process is left."""
    app, env = _plain_loop_app(tmp_path)
    (app / "stuck.py").write_text(STUCK_APP)
    run = subprocess.run(
        [sys.executable, "stuck.py", "-m", "hparams_search=gpuopt", "hydra.sweeper.n_trials=1",
         "hydra.sweeper.baseline=false", "hydra.sweeper.confirm.rounds=0",
         "+hydra.callbacks.gpuopt_measure.budget_s=3"],
        cwd=app, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    log = run.stdout + run.stderr
    study = optuna.load_study(
        study_name="plain_loop", storage=f"sqlite:///{tmp_path / 'out' / 'gpuopt.db'}"
    )
    (trial,) = study.trials
    reason = trial.user_attrs["reason"]
    assert trial.user_attrs["status"] == "error", log[-3000:]
    assert reason.startswith("not measured: no optimizer step within budget_s=3 s"), reason
    assert "then the trial process" in reason and "timed out" not in reason
    left = subprocess.run(["pgrep", "-f", str(app)], capture_output=True, text=True)
    assert left.stdout == "", left.stdout


def _plain_loop_app(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    app = tmp_path / "app"
    shutil.copytree(HELPERS / "plain_loop_app", app)
    shutil.copy(MNIST_MAIN, app / "main.py")
    shutil.copy(HELPERS / "torchvision_stand_in.py", app / "torchvision_stand_in.py")
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "GPUOPT_OUTPUT_DIR": str(out)}
    env.pop("HYDRA_FULL_ERROR", None)
    return app, env


@pytest.mark.slow
def test_a_plain_loop_is_swept_with_the_callback_in_yaml_alone(tmp_path):
    """pytorch/examples' mnist loop in a user's Hydra app; the sweep preset names gpuopt.MeasureJob
    and gpuopt's sweeper. Every trial measured, a baseline, no process left. (A confirmation of a
    measured app's trials: test_examples' sweep.)"""
    app, env = _plain_loop_app(tmp_path)
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "train.py", "-m", "hparams_search=gpuopt", "hydra.sweeper.n_trials=2",
         "hydra.sweeper.confirm.rounds=0"],
        cwd=app, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-3000:]
    summary = log.split("gpuopt sweep summary")[1]
    assert "objectives: throughput (maximize) | trials: ok 2" in summary
    assert "baseline  #0: throughput=" in summary
    study = optuna.load_study(study_name="plain_loop", storage=f"sqlite:///{out / 'gpuopt.db'}")
    for trial in study.trials:
        measured = json.loads(
            (Path(trial.user_attrs["run_dir"]) / "gpuopt_measured.json").read_text()
        )
        assert measured["status"] == "ok"
        assert trial.user_attrs["global_batch"] == trial.params.get("batch_size", 64)
    assert study.trials[0].user_attrs["lr"] == 1.0  # mnist's Adadelta lr, from its param group
    # The search space found in the baseline's run: the app's own keys, traced from its values.
    proposal = (
        Path(study.trials[0].user_attrs["run_dir"]) / "gpuopt_search_space.yaml"
    ).read_text()
    assert "batch_keys: [batch_size]" in proposal and "num_workers: choice(0, 1" in proposal
    left = subprocess.run(["pgrep", "-f", str(app)], capture_output=True, text=True)
    assert left.stdout == "", left.stdout


@pytest.mark.slow
def test_a_killed_sweep_of_a_plain_loop_leaves_no_process_behind(tmp_path):
    """kill -9 of the sweep while a trial trains with a DataLoader worker: the trial process, its
    controller and its worker end with the sweep (gpuopt's lifeline), nothing is left."""
    app, env = _plain_loop_app(tmp_path)
    sweep = subprocess.Popen(
        [sys.executable, "train.py", "-m", "hparams_search=gpuopt", "num_workers=1",
         "hydra.callbacks.gpuopt_measure.measure={time_budget_s:60,min_time_s:60}"],
        cwd=app, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def running() -> list[str]:
        found = subprocess.run(["pgrep", "-f", str(app)], capture_output=True, text=True)
        return [pid for pid in found.stdout.split() if int(pid) != sweep.pid]

    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not list(app.glob("multirun/*/*/0/train.log")):
            time.sleep(0.2)
        time.sleep(3)  # the trial trains: its loader's worker is up
        assert len(running()) >= 3, running()  # the controller, the trial, its worker
        sweep.send_signal(signal.SIGKILL)
        sweep.wait(timeout=10)
        deadline = time.monotonic() + 20
        while running() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not running(), "processes of the killed sweep's trial still run"
    finally:
        for pid in running():
            os.kill(int(pid), signal.SIGKILL)


def test_a_batch_without_tensors_never_breaks_the_jobs_loop(meter):
    words = DataLoader(["a", "b", "c", "d"], batch_size=2, collate_fn=list)
    assert [batch for batch in words] == [["a", "b"], ["c", "d"]]
    assert meter.batches == 2 and meter.unmeasured().reason.endswith(
        "never stepped a torch.optim optimizer (its step hooks saw none)"
    )
