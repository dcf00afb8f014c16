"""Bad input through the real CLIs: one line on stderr naming the key and value, exit status 2,
and nothing created (no run dir, no database, no result.json) - for `python -m gpuopt.run` and
`python -m gpuopt.report`. Rows are (argv, expected substring of the line); `{tmp}` in an argument
is the test's empty working directory. A row's `torch` says the check needs torch (targets that
must import, the device); every other row runs with torch made unimportable, which proves that it
fails before torch is imported. Sweep rows (`gpuopt.run -m`, SWEEP) fail before any study or
database exists. Each row runs in a process of its own, forked from one that has Hydra, Optuna and
gpuopt's torch-free modules imported (tests/helpers/forked_cli.py), the CLI's module run afresh as
`__main__`.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.forked_cli import CliForks
from tests.helpers.postgres import PASSWORD_LOGIN, find_pg_bin, postgres_server

REPO = Path(__file__).resolve().parents[1]
BROKEN_YAML = "_target_: gpuopt.workload.models.MLP\ninput: vectors\n  width: [1, 2\n"


@dataclass(frozen=True)
class Row:
    argv: tuple[str, ...]
    expected: str  # a substring of the one stderr line: the key, and the value where it shows
    module: str = "gpuopt.run"
    torch: bool = False  # the check needs torch (importing targets, asking the device)
    first: bool = False  # checked before the machine is probed: nothing else printed before it

    @property
    def id(self) -> str:
        return f"{self.module.split('.')[-1]}: {' '.join(self.argv) or '(no arguments)'}"


def run_rows(*rows: tuple[str | tuple[str, ...], str] | Row) -> list[Row]:
    out = []
    for row in rows:
        if isinstance(row, Row):
            out.append(row)
            continue
        argv, expected = row
        out.append(Row(tuple(argv.split()) if isinstance(argv, str) else argv, expected))
    return out


RUN = run_rows(
    # keys the schema lacks, values of the wrong type (OmegaConf's schema, at composition or after)
    ("+foo=1", "foo=1; allowed: a key of GpuoptConf"),
    ("+model.widht=3", "model.widht=3; allowed: a key of MLPConf"),
    ("+data.bogus=1", "data.bogus=1"),
    ("loader.batch_size=abc", "loader.batch_size='abc'; allowed: an integer"),
    ("loader.pin_memory=maybe", "loader.pin_memory='maybe'; allowed: true | false"),
    ("model.width=abc", "model.width='abc'; allowed: an integer"),
    ("trust=notalist", "trust"),
    # ranges of gpuopt's own model and data (measured as "ok" or crashed at build time before)
    ("model.depth=-2", "model.depth=-2; allowed: an integer >= 1"),
    ("model.width=0", "model.width=0; allowed: an integer >= 1"),
    ("model.num_classes=0", "model.num_classes=0"),
    ("model=transformer model.heads=3", "model.heads=3; allowed: a divisor of model.width (128)"),
    ("model=transformer model.heads=0", "model.heads=0"),
    ("model.input_shape=[0]", "model.input_shape=[0]"),
    ("model=cnn model.input_shape=[3,32]", "model.input_shape=[3, 32]"),
    ("data.size=0", "data.size=0; allowed: an integer >= 1"),
    ("data.size=8", "data.size=8; allowed: an integer >= loader.batch_size (32)"),
    ("data.sample_cost=-1", "data.sample_cost=-1"),
    ("data.kind=tokens", "data.kind='tokens'"),
    ("+model.channels_last=true", "model.channels_last=True"),
    # the typed groups
    ("loader.batch_size=0", "loader.batch_size=0; allowed: an integer >= 1"),
    ("loader.batch_size=-5", "loader.batch_size=-5"),
    ("loader.num_workers=-1", "loader.num_workers=-1"),
    ("loader.num_workers=1000", "loader.num_workers=1000; allowed: an integer >= 0 and <="),
    ("loader.prefetch_factor=0", "loader.prefetch_factor=0"),
    ("precision.mode=fp8", "precision.mode='fp8'; allowed: fp32 | tf32 | fp16 | bf16"),
    ("compile.mode=turbo", "compile.mode='turbo'"),
    ("cache.empty_cache=always", "cache.empty_cache='always'"),
    ("cache.every_n_steps=0", "cache.every_n_steps=0"),
    ("cache.cuda_alloc_conf=bogus", "cache.cuda_alloc_conf='bogus'"),
    ("optimizer.name=lion", "optimizer.name='lion'"),
    ("optimizer.lr=-1", "optimizer.lr=-1"),
    ("optimizer.fused=true optimizer.foreach=true", "optimizer.fused=True"),
    ("device.type=tpu", "device.type='tpu'"),
    ("device.num_threads=0", "device.num_threads=0"),
    ("device.num_threads=1000", "device.num_threads=1000"),
    ("measure.warmup_steps=-1", "measure.warmup_steps=-1"),
    ("measure.min_steps=1", "measure.min_steps=1"),
    ("measure.max_steps=1", "measure.max_steps=1"),
    ("measure.time_budget_s=0", "measure.time_budget_s=0"),
    ("measure.stability_target=3", "measure.stability_target=3"),
    ("engine.name=bogus", "engine.name='bogus'"),
    ("seed=-1", "seed=-1"),
    ("loss=hinge", "loss='hinge'"),
    ("model._target_=os.system", "model._target_='os.system'; allowed: targets matching"),
    ("data._target_=os.system", "data._target_='os.system'"),
    # composition: unknown group options, override syntax, files, arguments
    (
        "model=nope",
        "model='nope'; allowed: cnn | hf_bert | hf_gpt2 | hf_gpt2_tiny | hf_llama | hf_resnet | hf_vit | mlp | transformer",
    ),
    ("precision=fp8", "precision='fp8'"),
    ("engine=nope", "engine='nope'"),
    ("model.width=[", "model.width='['; allowed: Hydra's override grammar"),
    ("loader.batch_size=8,16", "loader.batch_size='8,16'; allowed: one value in a single run"),
    ("+loader.batch_size=3", "loader.batch_size=3; allowed: loader.batch_size=... without '+'"),
    ("~nope", "nope"),
    (("--config-dir", "{tmp}/myconf", "model=broken"), "broken.yaml, line 3, column 8"),
    (("--config-dir", "{tmp}/nonexistent"), "--config-dir='{tmp}/nonexistent'"),
    ("--config-name nope", "--config-name='nope'"),
    ("--bogus", "unrecognized arguments: --bogus"),
    ("--cfg bogus", "--cfg"),
    ("hydra.run.dir=/proc/gpuopt/run", "hydra.run.dir='/proc/gpuopt/run'"),
    # checks that import the targets or ask the device
    Row(
        ("model._target_=tests.helpers.no_such_module.Net", "trust=[tests.*]"),
        "model._target_='tests.helpers.no_such_module.Net'; allowed: an importable",
        torch=True,
    ),
    Row(("device.type=cuda:99",), "device.type='cuda:99'", torch=True),
    Row(("device=cpu", "precision=tf32"), "precision.mode='tf32'", torch=True),
)

REPORT = [
    Row(argv, expected, module="gpuopt.report")
    for argv, expected in [
        (("--bogus",), "unrecognized arguments: --bogus"),
        (("--top", "0"), "--top=0"),
        (("--top", "abc"), "--top"),
        (("--trial", "-1"), "--trial=-1"),
        (("--trial", "abc"), "--trial"),
        (("--html", "/proc/gpuopt/x.html"), "--html='/proc/gpuopt/x.html'"),
        (("--html", "{tmp}"), "--html='{tmp}'; allowed: a file path"),
        (("--export-best", "/proc/gpuopt/best.yaml"), "--export-best='/proc/gpuopt/best.yaml'"),
        (("--export-best", f"{REPO / 'README.md'}/best.yaml"), "--export-best="),
        (("--html", "{tmp}/r.html", "--export-best", "{tmp}/r.html"), "a path other than --html"),
        (("--storage", "bogus://x"), "bogus://x"),
        (("--storage", "sqlite:///{tmp}/missing/x.db"), "{tmp}/missing/x.db"),
        (
            ("--storage", "postgresql+psycopg://u@127.0.0.1:1/db?password=s3cretpw"),
            "cannot connect to postgresql+psycopg://u@127.0.0.1:1/db?password=***: "
            "connection refused",
        ),
        ((), "no study database"),
    ]
]

# `python -m gpuopt.run -m`: the sweeper's settings (SweeperOptions), its storage, and the composed
# config checked once (gpuopt.core.checks.check_composed / check_device_facts) before any study exists.
SWEEP = run_rows(
    ("-m hydra.sweeper.n_trials=0", "hydra.sweeper.n_trials=0; allowed: an integer >= 1"),
    ("-m hydra.sweeper.n_trials=-1", "hydra.sweeper.n_trials=-1; allowed: an integer >= 1"),
    ("-m hydra.sweeper.n_jobs=0", "hydra.sweeper.n_jobs=0; allowed: an integer >= 1"),
    (
        "-m hydra.sweeper.max_failure_rate=2",
        "hydra.sweeper.max_failure_rate=2.0; allowed: a number in [0, 1]",
    ),
    (
        "-m hydra.sweeper.confirm.rounds=-1",
        "hydra.sweeper.confirm.rounds=-1; allowed: an integer >= 0",
    ),
    ("-m hydra.sweeper.confirm.top_k=0", "hydra.sweeper.confirm.top_k=0"),
    ("-m hydra.sweeper.confirm.max_share=0", "hydra.sweeper.confirm.max_share=0"),
    (
        "-m hydra.sweeper.confirm.window_s=0",
        "hydra.sweeper.confirm.window_s=0.0; allowed: seconds in [0.1, 60]",
    ),
    ("-m hydra.sweeper.heartbeat_interval=-5", "hydra.sweeper.heartbeat_interval=-5"),
    ("-m hydra.sweeper.env_timeout_s=0", "hydra.sweeper.env_timeout_s=0"),
    ("-m hydra.sweeper.direction=sideways", "hydra.sweeper.direction="),
    ("-m hydra.sweeper.objectives=[bogus]", "hydra.sweeper.objectives='bogus'"),
    (  # a metric of a task's own: gpuopt's own task has none
        "-m hydra.sweeper.objectives=[throughput,val_acc] hydra.sweeper.direction=[maximize,maximize]",
        "hydra.sweeper.objectives='val_acc'; allowed: gpuopt's metric names",
    ),
    ("-m hydra.sweeper.bogus=1", "hydra.sweeper.bogus=1"),
    # the storage: checked before the machine probe and its device-aware lines (first=True)
    Row(
        ("-m", "hydra.sweeper.storage=bogus://x"),
        "hydra.sweeper.storage='bogus://x'; allowed: an Optuna storage URL",
        first=True,
    ),
    Row(
        ("-m", "hydra.sweeper.storage=sqlite:////nonexistent/dir/x.db"),
        "hydra.sweeper.storage='sqlite:////nonexistent/dir/x.db'; allowed: a SQLite file in an existing folder",
        first=True,
    ),
    Row(  # a closed port: nothing listens on port 1
        ("-m", "hydra.sweeper.storage=postgresql+psycopg://u:s3cretpw@127.0.0.1:1/db"),
        "gpuopt: cannot connect to postgresql+psycopg://u:***@127.0.0.1:1/db: connection refused",
        first=True,
    ),
    Row(  # unquoted, `?` fails Hydra's override grammar, whose error line quotes the value
        ("-m", "hydra.sweeper.storage=postgresql+psycopg://u@127.0.0.1:1/db?password=s3cretpw"),
        "hydra.sweeper.storage='postgresql+psycopg://u@127.0.0.1:1/db?password=***'; allowed: "
        "Hydra's override grammar",
        first=True,
    ),
    Row(  # quoted: the grammar takes it, the server is not there
        ("-m", "hydra.sweeper.storage='postgresql+psycopg://u@127.0.0.1:1/db?password=s3cretpw'"),
        "gpuopt: cannot connect to postgresql+psycopg://u@127.0.0.1:1/db?password=***: "
        "connection refused",
        first=True,
    ),
    (("-m", "--config-dir", "{tmp}/myconf", "model=broken"), "broken.yaml, line 3, column 8"),
    ("-m +foo=1", "foo=1; allowed: a key of GpuoptConf"),
    ("-m loader.batch_size=0", "loader.batch_size=0; allowed: an integer >= 1"),
    ("-m model=transformer model.heads=3", "model.heads=3; allowed: a divisor of model.width"),
    ("-m device.type=cuda", "device.type='cuda'; allowed: cpu | auto here"),
    ("-m loader.num_workers=1000", "loader.num_workers=1000"),
)

ROWS = RUN + REPORT + SWEEP


def _env(tmp: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "GPUOPT_OUTPUT_DIR": str(tmp / "outputs"),
        "PYTHONPATH": str(REPO),  # tests.helpers targets
        "COLUMNS": "300",
    }
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def _run(row: Row, tmp: Path, cli_forks: CliForks) -> subprocess.CompletedProcess:
    """`python -m <module> *argv` in `tmp`, in a process of its own forked from one that has the
    CLIs' torch-free modules imported (tests/helpers/forked_cli.py); `import torch` fails in it
    unless the row needs torch (then the child imports it, as a fresh process would)."""
    argv = [arg.replace("{tmp}", str(tmp)) for arg in row.argv]
    return cli_forks.run(row.module, argv, tmp, _env(tmp), no_torch=not row.torch)


def test_the_table_has_45_distinct_inputs():
    assert len({(row.module, row.argv) for row in ROWS}) == len(ROWS) >= 45
    assert len({row.argv for row in SWEEP}) == len(SWEEP) >= 15


@pytest.mark.skipif(find_pg_bin() is None, reason="PostgreSQL server binaries not installed")
def test_a_refused_database_login_is_the_first_and_only_line(tmp_path, cli_forks):
    """A real PostgreSQL server (tests/helpers/postgres.py) and a role that must give its password
    (scram-sha-256 over TCP), given a wrong one each way a URL carries it (one server for both).
    The storage is checked before the machine is probed: its line, in the server's words, is the
    sweep's first and only output; exit 2, nothing created, and the password never shows."""
    import psycopg

    procs = {}
    with postgres_server() as url:
        conninfo = url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(f"CREATE ROLE refused LOGIN PASSWORD 'right-pw' IN ROLE {PASSWORD_LOGIN}")
        where = url.split("@", 1)[1]  # 127.0.0.1:PORT/gpuopt
        for form, bad, shown in [
            ("user-password-at-host", f"refused:s3cretpw@{where}", f"refused:***@{where}"),
            (
                "password-query",
                f"refused@{where}?password=s3cretpw",
                f"refused@{where}?password=***",
            ),
        ]:
            cwd = tmp_path / form
            cwd.mkdir()
            row = Row(("-m", f"hydra.sweeper.storage='postgresql+psycopg://{bad}'"), "", first=True)
            procs[form] = (_run(row, cwd, cli_forks), shown, cwd)
    for form, (proc, shown, cwd) in procs.items():
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (form, proc.stderr[-3000:])
        assert lines[0] == (
            f"gpuopt: cannot connect to postgresql+psycopg://{shown}: "
            'password authentication failed for user "refused"'
        )
        assert not proc.stdout.strip(), f"{form}: printed before the storage line"
        assert "s3cretpw" not in proc.stderr + proc.stdout
        assert not any(cwd.iterdir()), f"{form}: created {list(cwd.iterdir())}"


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_bad_input_is_one_line_exit_2_and_nothing_created(row, tmp_path, cli_forks):
    (tmp_path / "myconf" / "model").mkdir(parents=True)
    (tmp_path / "myconf" / "model" / "broken.yaml").write_text(BROKEN_YAML)
    before = set(tmp_path.rglob("*"))
    proc = _run(row, tmp_path, cli_forks)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert row.expected.replace("{tmp}", str(tmp_path)) in lines[0]
    assert set(tmp_path.rglob("*")) == before, "bad input created files"
    if row.first:  # no device probe, no device-aware trimming before the line
        assert not proc.stdout.strip(), proc.stdout[-3000:]
    assert not Path("/proc/gpuopt").exists()
