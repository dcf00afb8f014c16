"""A user's own training script swept by gpuopt, as docs/your-training.md tells a new user to write it.

The script defines its Dataset and model classes next to its `@hydra.main` task (the most common
shape of user code); gpuopt's launchers must run it in fresh processes without pickling those
classes by value (gpuopt.sweeper.launchers.main_task: cloudpickle, pickling a class of `__main__`
by value, takes along `torch.classes` when a method says `self.classes`, and fails), and a sweep whose objectives are gpuopt's
metrics is fair by default: a baseline first, fresh processes, a confirmation at the end.
Also: the `src/train.py` layout that puts its project root on sys.path, a task run as
`python -m pkg.mod`, a task in an importable package, and the same script under SLURM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from gpuopt.study.keys import ATTR_BASELINE, STUDY_CONFIRMATION
from gpuopt.study.records import Confirmation
from gpuopt.sweeper.launchers.main_task import MainTask
from tests.helpers import slurm as slurm_helper

ROOT = Path(__file__).resolve().parent.parent

# The script a user writes (docs/your-training.md, "Tune your own training"): its own Dataset and
# nn.Module classes, and a task that hands its step to gpuopt.measure_step. It also notes the pid
# of the process it ran in, next to the trial's outputs.
SCRIPT = """
import os

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from torch import nn
from torch.utils.data import DataLoader, Dataset

import gpuopt


class Points(Dataset):
    def __init__(self, n):
        self.classes = ["neg", "pos"]  # torchvision's name: cloudpickle by value fails on it
        self.x, self.y = torch.randn(n, 8), torch.randint(0, len(self.classes), (n,))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 2)

    def forward(self, x):
        return self.layer(x)


@hydra.main(config_path="conf", config_name="config")
def main(cfg):
    out = HydraConfig.get().runtime.output_dir
    with open(os.path.join(out, "pid.txt"), "w") as f:
        f.write(str(os.getpid()))
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Points(256), batch_size=cfg.batch_size)

    def step(batch):
        x, y = batch
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    measure = {"warmup_steps": 2, "min_steps": 5, "max_steps": 30, "time_budget_s": 0.3,
               "min_time_s": 0.1, "peak_probe": False, "loader_cost": False}
    return gpuopt.measure_step(step, loader, model=model, measure=measure, ceiling=False)


if __name__ == "__main__":
    main()
"""

CONFIG = """
defaults:
  - override hydra/sweeper: gpuopt
  - _self_
batch_size: 32
hydra:
  sweeper:
    objectives: [throughput]
    storage: ${gpuopt.sqlite:gpuopt.db}
    study_name: mine
    n_trials: 20
    params:
      batch_size: choice(16, 64)
"""

# Tiny: the baseline and one searched trial, the other confirmed against the baseline in the paired
# minimum of 2 rounds (4 runs: max_share=2.0 of n_trials=2). Each run is a fresh process.
TINY = [
    "hydra.sweeper.n_trials=2",
    "hydra.sweeper.confirm.rounds=2",
    "hydra.sweeper.confirm.top_k=1",
    "hydra.sweeper.confirm.max_share=2.0",
    "hydra.sweeper.env_timeout_s=60",
]


def write_app(folder: Path) -> Path:
    (folder / "conf").mkdir(parents=True)
    (folder / "train.py").write_text(SCRIPT)
    (folder / "conf" / "config.yaml").write_text(CONFIG)
    return folder / "train.py"


def sweep(folder: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 400):
    proc = subprocess.Popen(
        [sys.executable, "train.py", "-m", *args],
        cwd=folder, env={**os.environ, "HYDRA_FULL_ERROR": "1", **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return proc.pid, out + err


def trials_of(folder: Path) -> tuple[optuna.Study, list[optuna.trial.FrozenTrial]]:
    study = optuna.load_study(study_name="mine", storage=f"sqlite:///{folder / 'gpuopt.db'}")
    return study, sorted(study.get_trials(), key=lambda t: t.number)


@pytest.mark.slow
def test_a_single_file_script_is_swept_fairly_by_default(tmp_path):
    """No launcher, baseline or confirmation setting: the objectives are gpuopt's metrics, so the
    trials run in fresh processes, the composed config first, and the confirmation ends the sweep."""
    write_app(tmp_path)
    sweep_pid, log = sweep(tmp_path, *TINY)
    assert "trials run in fresh processes (hydra/launcher=fresh_process)" in log
    study, trials = trials_of(tmp_path)
    assert len(trials) == 2 and all(t.state is TrialState.COMPLETE for t in trials), trials
    assert all(t.user_attrs["status"] == "ok" for t in trials)
    pids = [int(Path(t.user_attrs["run_dir"], "pid.txt").read_text()) for t in trials]
    assert len(set(pids)) == 2 and sweep_pid not in pids  # each trial in a process of its own
    baseline = trials[0]
    assert baseline.user_attrs.get(ATTR_BASELINE) is True
    assert not any(o.startswith("batch_size=") for o in baseline.user_attrs["overrides"])
    assert not any(t.user_attrs.get(ATTR_BASELINE) for t in trials[1:])
    confirmation = Confirmation.from_attr(study.user_attrs[STUDY_CONFIRMATION])
    assert confirmation is not None and confirmation.comparisons  # the confirmation ended it
    assert confirmation.configs[0].label == "baseline"
    assert confirmation.configs[0].trial_number == 0 and confirmation.configs[0].confirm_values


def test_an_app_that_chose_the_basic_launcher_keeps_it(tmp_path):
    """`hydra/launcher=basic` on the command line or in the app's defaults is a choice; Hydra's
    default `basic` is not (the composed choice reads `basic` in all three)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    import gpuopt.sweeper.plugin  # noqa: F401  (hydra/sweeper=gpuopt)
    from gpuopt.core._compat import launcher_chosen

    write_app(tmp_path)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(tmp_path / "conf")):
            loader = GlobalHydra.instance().config_loader()
            for overrides, chosen in (([], False), (["hydra/launcher=basic"], True)):
                cfg = loader.load_configuration("config", overrides, RunMode.MULTIRUN)
                assert cfg.hydra.runtime.choices["hydra/launcher"] == "basic"
                assert launcher_chosen(loader, cfg) is chosen, overrides
            (tmp_path / "conf" / "config.yaml").write_text(
                CONFIG.replace("  - _self_", "  - override hydra/launcher: basic\n  - _self_")
            )
            cfg = loader.load_configuration("config", [], RunMode.MULTIRUN)
            assert launcher_chosen(loader, cfg) is True
    finally:
        GlobalHydra.instance().clear()


def test_the_launcher_names_of_any_app_leave_gpuopts_own_yaml_first():
    """`fresh_process` and `slurm` are ConfigStore names for any app; in gpuopt's own app its
    conf/hydra/launcher/*.yaml (first on the search path) still compose, with their defaults."""
    from hydra import compose, initialize_config_dir, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from gpuopt.core.spec import register_schemas

    register_schemas()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module("gpuopt.conf"):
            own = compose("config", ["~search", "hydra/launcher=slurm"], return_hydra_config=True)
        assert own.hydra.launcher.cpus_per_task == 8  # conf/hydra/launcher/slurm.yaml
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(ROOT / "tests" / "third_party")):
            for name, target in (("fresh_process", "FreshProcessLauncher"), ("gpuopt_local", "FreshProcessLauncher"),
                                 ("slurm", "GpuoptSlurmLauncher"), ("gpuopt_slurm", "GpuoptSlurmLauncher")):  # fmt: skip
                app = compose(overrides=[f"hydra/launcher={name}"], return_hydra_config=True)
                assert app.hydra.launcher._target_.endswith(target), name
    finally:
        GlobalHydra.instance().clear()


# ---- the task found again by name in a fresh process (the launcher's pickle, without submitit) ----

PICKLE_MAIN = """
if __name__ == "__main__":
    import os
    import sys

    import cloudpickle

    from gpuopt.sweeper.launchers.main_task import for_main

    task_function = main.__wrapped__
    with open(sys.argv[1], "wb") as f:  # GPUOPT_TEST_BY_VALUE: as cloudpickle alone would
        by_value = os.environ.get("GPUOPT_TEST_BY_VALUE")
        cloudpickle.dump(task_function if by_value else for_main(task_function), f)
    print("pickled in the main script")
"""

CALL_PICKLE = """
import json, os, pickle, sys
with open(sys.argv[1], "rb") as f:
    task = pickle.load(f)
print(json.dumps({"proxy": type(task).__name__, "result": task({"x": 3}), "main": __name__}))
"""


def pickle_and_call(script: list[str], cwd: Path, tmp_path: Path) -> dict:
    """Pickle the script's task the way the launcher does (in `python <script>`), then load and call
    it in a fresh interpreter elsewhere (as submitit's job does): what it returned."""
    pkl = tmp_path / "task.pkl"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    made = subprocess.run([sys.executable, *script, str(pkl)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert made.returncode == 0 and "pickled in the main script" in made.stdout, made.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    called = subprocess.run([sys.executable, "-c", CALL_PICKLE, str(pkl)], cwd=elsewhere, env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert called.returncode == 0, called.stderr[-3000:]
    assert "pickled in the main script" not in called.stdout  # its __main__ block did not run
    return json.loads(called.stdout.strip().splitlines()[-1])


def test_a_script_task_with_its_own_dataset_class_pickles_by_reference(tmp_path):
    app = tmp_path / "app"
    write_app(app)
    script = SCRIPT.replace("    main()\n", "    pass\n") + textwrap.dedent(
        """
        def task(cfg):
            return [type(Points(2)).__module__, len(Points(cfg["x"])), Net().layer.in_features]
        """
    )
    (app / "train.py").write_text(script + PICKLE_MAIN.replace("main.__wrapped__", "task"))
    got = pickle_and_call(["train.py"], app, tmp_path)
    assert got["proxy"] == "MainTask" and got["result"] == ["__mp_main__", 3, 8]
    # What the launcher would have sent otherwise: the script's classes by value, which fails.
    by_value = subprocess.run(
        [sys.executable, "train.py", str(tmp_path / "by_value.pkl")],
        cwd=app, env={**os.environ, "GPUOPT_TEST_BY_VALUE": "1"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert by_value.returncode != 0 and "cannot pickle" in by_value.stderr, by_value.stderr


def test_a_src_layout_script_that_puts_its_root_on_sys_path(tmp_path):
    """lightning-hydra-template's layout: src/train.py adds the project root to sys.path (as
    rootutils does) and imports `src.models`; the task is Hydra's decorated main."""
    root = tmp_path / "project"
    (root / "src").mkdir(parents=True)
    (root / "configs").mkdir()
    (root / ".project-root").write_text("")
    (root / "src" / "__init__.py").write_text("")
    (root / "src" / "models.py").write_text("class Net:\n    width = 7\n")
    (root / "src" / "train.py").write_text(
        textwrap.dedent(
            """
            import sys
            from pathlib import Path

            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

            import hydra

            from src.models import Net


            @hydra.main(config_path="../configs", config_name=None)
            def main(cfg):
                return [Net.width * cfg["x"], Net.__module__]
            """
        )
        + PICKLE_MAIN
    )
    got = pickle_and_call(["src/train.py"], root, tmp_path)
    assert got["proxy"] == "MainTask" and got["result"] == [21, "src.models"]


def test_a_task_run_as_a_module_and_one_in_an_importable_package(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "tasks.py").write_text("def task(cfg):\n    return ['tasks', cfg['x'] + 1]\n")
    (pkg / "train.py").write_text(
        "import hydra\n\n\n@hydra.main(config_path=None)\n"
        "def main(cfg):\n    return [__name__, cfg['x']]\n" + PICKLE_MAIN
    )
    got = pickle_and_call(["-m", "mypkg.train"], tmp_path, tmp_path)
    assert got["proxy"] == "MainTask" and got["result"] == ["mypkg.train", 3]
    # A task of an importable module is left as it is: cloudpickle sends it by reference.
    (pkg / "run.py").write_text(
        "import sys\nsys.path.insert(0, '.')\nfrom mypkg.tasks import task\n"
        + PICKLE_MAIN.replace("main.__wrapped__", "task")
    )
    pkl = tmp_path / "plain.pkl"
    made = subprocess.run([sys.executable, "mypkg/run.py", str(pkl)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert made.returncode == 0, made.stderr
    called = subprocess.run([sys.executable, "-c", CALL_PICKLE, str(pkl)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)},
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert called.returncode == 0, called.stderr[-2000:]
    got = json.loads(called.stdout.strip().splitlines()[-1])
    assert got["proxy"] == "function" and got["result"] == ["tasks", 4]


def test_the_proxy_is_only_for_a_task_of_the_main_script():
    from gpuopt.sweeper.launchers.main_task import for_main

    assert for_main(test_the_proxy_is_only_for_a_task_of_the_main_script) is (
        test_the_proxy_is_only_for_a_task_of_the_main_script
    )

    def local(cfg):
        return cfg

    local.__module__ = "__main__"
    assert for_main(local) is local  # nested: cannot be found by name, pickled as before
    assert MainTask("main", path="/x/train.py").qualname == "main"


# ---- the same script under SLURM (tests/test_slurm.py's cluster) ----------------------------------


@pytest.fixture(scope="module")
def cluster():
    with slurm_helper.slurm_cluster() as running:
        yield running


@pytest.mark.slow
@pytest.mark.skipif(slurm_helper.missing() is not None, reason=str(slurm_helper.missing()))
def test_a_script_task_runs_as_a_slurm_job(tmp_path, cluster):
    """hydra/launcher=slurm (gpuopt's name, registered for any app): one tiny job, the baseline."""
    write_app(tmp_path)
    _, log = sweep(
        tmp_path,
        "hydra/launcher=slurm",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.mem_gb=1",
        "hydra.launcher.poll_s=1",
        "hydra.launcher.timeout_min=5",
        "hydra.sweeper.n_trials=1",
        "hydra.sweeper.confirm.rounds=0",
        "hydra.sweeper.env_timeout_s=60",
        env=cluster.env,
        timeout=300,
    )
    assert "trials run in fresh processes" not in log  # the app chose its launcher
    _, trials = trials_of(tmp_path)
    assert len(trials) == 1 and trials[0].state is TrialState.COMPLETE, trials[0].user_attrs
    assert trials[0].user_attrs.get(ATTR_BASELINE) is True
    logs = list(tmp_path.glob("multirun/*/*/.submitit/*/*_log.out"))
    assert len(logs) == 1 and "Starting with JobEnvironment(job_id=" in logs[0].read_text()


# ---- a launcher failure is a failed trial, the baseline's too -------------------------------------


def test_a_baseline_the_launcher_failed_is_a_failed_trial_not_skipped():
    """The baseline whose job could not be pickled (or whose process died) is an `error` trial with
    the launcher's reason, counted for max_failure_rate; only a baseline whose task raised (its
    config does not run on its own) is skipped."""
    import time
    from types import SimpleNamespace

    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from gpuopt.study.keys import ATTR_BASELINE_SKIPPED, ATTR_REASON
    from gpuopt.sweeper import resume
    from gpuopt.sweeper.launchers.results import TrialProcessError, failed_return
    from gpuopt.sweeper.options import SweeperOptions
    from gpuopt.sweeper.progress import Progress
    from gpuopt.sweeper.trials import TrialRunner

    def task_raised() -> JobReturn:
        ret = JobReturn(overrides=[], status=JobStatus.FAILED)
        ret.return_value = KeyError("w")
        return ret

    cases = {
        "pickle": TypeError("cannot pickle '_Classes' object"),  # launcher.launch raised
        "crash": failed_return([], TrialProcessError("killed by signal SIGSEGV", "log")),
        "task": task_raised(),
    }
    runner = TrialRunner(
        launcher=None,
        options=SweeperOptions.build(objectives=["throughput"]),
        config=OmegaConf.create({}),
        n_trials=3,
        storage_text="memory",
        recovery=resume.Recovery(0),
    )
    for name, ret in cases.items():
        study = optuna.create_study(direction="maximize")
        study.enqueue_trial({}, user_attrs={ATTR_BASELINE: True})
        trial = study.ask()
        progress = Progress(3, ["throughput"], ["maximize"], t_start=time.monotonic())
        runner.record(study, trial, [], ret, SimpleNamespace(is_grid=False), progress)  # type: ignore[arg-type]
        frozen = study.get_trials()[0]
        assert frozen.state is TrialState.FAIL, name
        skipped = ATTR_BASELINE_SKIPPED in frozen.user_attrs
        assert skipped is (name == "task"), (name, frozen.user_attrs)
        if name != "task":
            assert frozen.user_attrs["status"] == "error"
            reason = frozen.user_attrs[ATTR_REASON]
            assert ("cannot pickle" if name == "pickle" else "SIGSEGV") in reason
