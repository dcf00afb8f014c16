"""One trial over several ranks (`distributed=ddp | fsdp2`): the trial's process starts its ranks
with torch's elastic launcher (the API behind `torchrun`), waits for them and reports one result
for the whole job (gpuopt.trial.ranks merges the ranks' results).

- Rendezvous on a free port per trial (parallel trials never collide on 29500); over several
  nodes at `distributed.rdzv_endpoint` or a SLURM job's first node (gpuopt.core.rendezvous),
  every node's trial merging every rank's result from the shared run directory.
- A short timeout (`distributed.timeout_s`, not NCCL's ten minutes) and no restarts: a failed
  rank is the trial's answer, not something to retry.
- Every rank asks for SIGKILL when its parent dies (gpuopt.core.lifeline), so a `kill -9` of the
  trial leaves no rank behind.

Each rank writes its `TrialResult` (rank_N.json) into a scratch folder and its output into the
launcher's logs, so a rank that crashed without a result is still reported with its stderr. The
ranks run outside Hydra: the run directory is handed down as $GPUOPT_RUN_DIR. The rank's work is
the caller's `entry(spec, device)` (gpuopt.engines.registry.run_rank, never imported here, or
the memory probe's rank).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuopt.core.checks import check_module_patterns
from gpuopt.core.errors import ConfigError
from gpuopt.core.host import usable_cpus
from gpuopt.core.lifeline import set_parent_death_signal
from gpuopt.core.rank_files import RANKS_FOLDER, RESULT_FILE
from gpuopt.core.rendezvous import slurm_endpoint
from gpuopt.core.result import Status, TrialResult
from gpuopt.core.spec import MODEL_META_KEYS, TrialSpec
from gpuopt.trial import numerics
from gpuopt.trial.profiled_window import RUN_DIR_ENV, hydra_run_dir, known_run_dir
from gpuopt.trial.ranks import RankFailure, merge_ranks

if TYPE_CHECKING:
    import torch

RankEntry = Callable[[TrialSpec, "torch.device"], TrialResult]
# The launcher's grace between SIGTERM and SIGKILL when it ends the other ranks of a failed trial.
SHUTDOWN_TIMEOUT_S = 5
# Lines of a crashed rank's stderr kept at each end in the reason.
STDERR_LINES = 8
# The rendezvous's extra time beyond the collective timeout: ranks import torch before they join.
RENDEZVOUS_START_S = 60.0
# The launcher's loggers (its rank failures, the ranks it terminates).
QUIET_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")
# gpuopt's own models, whose module patterns are checked before the ranks start.
BUILTIN_MODELS = "gpuopt.workload.models."


def free_port() -> int:
    """A TCP port nobody listens on now (the kernel's pick), for this trial's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def backend_for(spec: TrialSpec, device: torch.device) -> str:
    """`distributed.backend`, auto resolved: NCCL on CUDA, gloo elsewhere."""
    backend = spec.distributed.backend
    if backend != "auto":
        return backend
    return "nccl" if device.type == "cuda" else "gloo"


def launch_ranks(spec: TrialSpec, device: torch.device, entry: RankEntry) -> TrialResult:
    """Start `distributed.nproc_per_node` ranks running `entry`, wait for them, and return the
    trial's one result (never raises for a failing rank: that is the trial's status)."""
    dist = spec.distributed
    try:
        check_builtin_modules(spec)
        endpoint = rendezvous_endpoint(dist)
    except ConfigError as exc:  # the trial's answer, before any rank started
        return TrialResult(status=Status.ERROR, reason=str(exc))
    scratch, keep = _rank_folder(dist.nnodes)
    try:
        run_id = f"gpuopt-{uuid.uuid4().hex[:12]}"
        logs = scratch / "logs"
        if dist.nnodes > 1:  # every node's agent names one run; each its own log folder
            job, node = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_PROCID")
            run_id = f"gpuopt-slurm-{job}" if job and not dist.rdzv_endpoint else endpoint
            logs /= f"node_{node or f'{socket.gethostname()}-{os.getpid()}'}"
        timeout = dist.timeout_s + RENDEZVOUS_START_S
        config = launch_config(dist.nproc_per_node, dist.nnodes, endpoint, timeout, logs, run_id)
        # Hydra's run directory (or $GPUOPT_RUN_DIR) and the guard's reference cache, shared with
        # the sweep's trials: the ranks have no Hydra.
        found = {RUN_DIR_ENV: known_run_dir(), numerics.CACHE_ENV: numerics.sweep_cache_dir()}
        env = {name: str(path) for name, path in found.items() if path}
        args = (entry, spec, device.type, str(scratch), env)
        started = time.time()
        try:
            crashed = run_ranks(config, rank_main, args, scratch)
        except RanksNotStarted as exc:
            return TrialResult(
                status=Status.ERROR,
                reason=str(exc),
                warnings=[f"distributed={dist.kind}: no rank measured"],
            )
        return merged_result(scratch, dist.world_size, crashed, backend_for(spec, device), started)
    finally:
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)


class RanksNotStarted(Exception):
    """The rendezvous timed out or the launcher failed to start: no rank ran."""


def run_ranks(
    config: Any, rank_fn: Callable[..., None], args: tuple[Any, ...], folder: Path
) -> dict[int, RankFailure]:
    """Run `rank_fn(*args)` in every rank of `config`, each ending with this process, and wait for
    them (the launcher ends the others once one fails): the failed ranks, by global rank, each
    rank's output kept in `folder`. The one launch path of gpuopt's ranks and a user script's
    (gpuopt.processes.user_ranks)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    crashed: dict[int, RankFailure] = {}
    try:
        with quiet_launcher():
            elastic_launch(config, _with_lifeline)(os.getpid(), rank_fn, *args)
    except ChildFailedError as exc:
        crashed = crashes_of(exc, folder, config.nproc_per_node)
    except SignalException:  # this process itself was told to stop: not a result
        raise
    except Exception as exc:
        raise RanksNotStarted(f"the ranks did not start ({type(exc).__name__}: {exc})") from exc
    keep_logs(folder, config.max_nodes)
    return crashed


def _with_lifeline(parent: int, rank_fn: Callable[..., None], *args: Any) -> None:
    """A rank: SIGKILL when the launching process dies, then `rank_fn(*args)`."""
    set_parent_death_signal()
    if os.getppid() != parent:  # the launching process died before the signal was set
        os._exit(1)
    rank_fn(*args)


def merged_result(
    folder: Path, world_size: int, crashed: dict[int, RankFailure], backend: str, started: float
) -> TrialResult:
    """The job's one result from the ranks' results in `folder` (a rank killed before it finished
    wrote none) and the crashed ranks."""
    files = {rank: folder / RESULT_FILE.format(rank=rank) for rank in range(world_size)}
    results = {rank: TrialResult.load(path) for rank, path in files.items() if path.exists()}
    return merge_ranks(results, crashed, backend, time.time() - started)


def check_builtin_modules(spec: TrialSpec) -> None:
    """`shard_modules` / `checkpoint_modules` against a built-in model, before any rank starts
    (built on the meta device: milliseconds); any other model is checked in the ranks. Raises
    one ConfigError."""
    dist = spec.distributed
    target = str(spec.model.get("_target_", ""))
    patterns = {"shard_modules": dist.shard_modules, "checkpoint_modules": dist.checkpoint_modules}
    keys = [(key, found) for key, found in patterns.items() if found]
    if not keys or not target.startswith(BUILTIN_MODELS):
        return
    import torch
    from hydra.utils import get_object

    kwargs = {k: v for k, v in spec.model.items() if k not in (*MODEL_META_KEYS, "_target_")}
    try:
        with torch.device("meta"):
            model = get_object(target)(**kwargs)
    except Exception:  # a model that does not build: the ranks report it, as for any trial
        return
    classes = [type(m).__name__ for m in model.modules() if m is not model]
    for key, patterns in keys:
        if key == "shard_modules" and dist.kind != "fsdp2":
            continue  # ignored by ddp
        check_module_patterns(f"distributed.{key}", list(patterns), classes)


def _rank_folder(nnodes: int) -> tuple[Path, bool]:
    """Where the ranks write their results and logs, and whether it stays: `ranks/` in the run's
    directory under Hydra, else a temporary folder. Over several nodes it is shared: no node
    clears what another's ranks may have written already."""
    run_dir = hydra_run_dir()
    if run_dir is not None:
        folder = run_dir / RANKS_FOLDER
        if nnodes == 1:
            shutil.rmtree(folder, ignore_errors=True)  # an earlier trial in this run directory
        folder.mkdir(parents=True, exist_ok=True)
        return folder, True
    return Path(tempfile.mkdtemp(prefix="gpuopt-ranks-")), False


def rendezvous_endpoint(dist: Any) -> str:
    """`host:port` the trial's ranks meet at: a free local port for one node; over several nodes
    `distributed.rdzv_endpoint`, else the SLURM job's (ConfigError outside one)."""
    if dist.nnodes == 1:
        return dist.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    endpoint = dist.rdzv_endpoint or slurm_endpoint(os.environ)
    if endpoint is None:
        raise ConfigError(
            "distributed.nnodes",
            dist.nnodes,
            "1, or several with distributed.rdzv_endpoint=host:port (the first node's) or "
            "in a SLURM job of one task per node (hydra/launcher=slurm)",
        )
    return endpoint


def launch_config(
    nproc: int, nnodes: int, endpoint: str, timeout_s: float, logs: Path, run_id: str
) -> Any:
    """torch's elastic launch as gpuopt starts ranks: c10d rendezvous at `endpoint`, no restarts,
    spawned ranks, each rank's output in `logs`."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    timeout = int(timeout_s)
    return LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"timeout": timeout, "join_timeout": timeout},
        max_restarts=0,
        start_method="spawn",  # never fork a process that may hold a CUDA context
        logs_specs=DefaultLogsSpecs(log_dir=str(logs), redirects=Std.ALL),
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )


@contextlib.contextmanager
def quiet_launcher() -> Iterator[None]:
    """While the ranks run, the launcher's tracebacks of rank failures quiet (the trial reports
    them as its reason). The launcher installs handlers for SIGTERM, SIGINT, SIGHUP and SIGQUIT
    (they raise its SignalException) and leaves them: this process's own come back after."""
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    sigs = [getattr(signal, name) for name in names if hasattr(signal, name)]
    main = threading.current_thread() is threading.main_thread()  # signals: the main thread's
    previous = {sig: signal.getsignal(sig) for sig in sigs} if main else {}
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)


def crashes_of(exc: Any, scratch: Path, nproc_per_node: int) -> dict[int, RankFailure]:
    """What the launcher saw of each failed rank: its exit, its exception message, its stderr."""
    crashed = {}
    for rank, failure in exc.failures.items():
        exit_code = failure.exitcode
        how = f"exit code {exit_code}" if exit_code >= 0 else f"killed by {failure.signal_name()}"
        message = failure.message if isinstance(failure.message, str) else None
        if isinstance(failure.message, dict):
            message = failure.message.get("message")
        crashed[int(rank)] = RankFailure(
            how=how,
            message=message if message and "Signal" not in str(message) else None,
            stderr=_stderr_excerpt(scratch, int(rank) % nproc_per_node),
            at=float(failure.timestamp or 0),
        )
    return crashed


def keep_logs(scratch: Path, nnodes: int = 1) -> None:
    """Each rank's stdout/stderr copied out of the launcher's attempt folder (which it clears on
    shutdown) as rank_N.stdout.log / rank_N.stderr.log (node_K.rank_N... over several nodes)."""
    for log in (scratch / "logs").glob("**/attempt_*/*/std*.log"):
        node = next((p.name for p in log.parents if p.name.startswith("node_")), None)
        prefix = f"{node}." if nnodes > 1 and node else ""
        shutil.copyfile(log, scratch / f"{prefix}rank_{log.parent.name}.{log.name}")


def _stderr_excerpt(scratch: Path, rank: int) -> str | None:
    """The head and tail of a rank's stderr log (the launcher's redirect), or None."""
    logs = sorted((scratch / "logs").glob(f"**/attempt_*/{rank}/stderr.log"))  # this node's
    if not logs:
        return None
    lines = logs[-1].read_text(errors="replace").splitlines()
    lines = [line for line in lines if line.strip()]
    if len(lines) > 2 * STDERR_LINES:
        lines = [*lines[:STDERR_LINES], "...", *lines[-STDERR_LINES:]]
    return "\n".join(lines) or None


# -- in each rank ---------------------------------------------------------------------------------
class RankFailed(RuntimeError):
    """A rank's own result was not ok: raised so the launcher ends the other ranks at once."""


def rank_main(
    entry: RankEntry,
    spec: TrialSpec,
    device_type: str,
    scratch: str,
    env: dict[str, str],
) -> None:
    """One rank: join the process group, measure through `entry`, write the result. A failed
    result then raises, so the launcher stops the others instead of leaving them in a
    collective. No Hydra here: the trial hands down its paths as `env`."""
    os.environ.update(env)
    import torch.distributed as torch_dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = _rank_device(spec, device_type, local_rank)
    torch_dist.init_process_group(
        backend_for(spec, device),
        timeout=datetime.timedelta(seconds=spec.distributed.timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    try:
        result = entry(spec, device)
        result.env["rank"], result.env["local_rank"] = rank, local_rank
        if not result.ok:  # which rank failed first: the root cause, the others followed it
            result.env["failed_at"] = time.time()
        path = Path(scratch) / RESULT_FILE.format(rank=rank)
        path.write_text(json.dumps(result.to_dict(), default=str))
    finally:
        with contextlib.suppress(Exception):
            torch_dist.destroy_process_group()
    if not result.ok:
        raise RankFailed(f"rank {rank}: {result.status.value}: {result.reason}")


def _rank_device(spec: TrialSpec, device_type: str, local_rank: int) -> torch.device:
    """This rank's device (cuda:LOCAL_RANK on CUDA); on CPU the node's usable cores shared out
    between its ranks unless `device.num_threads` says."""
    import torch

    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device
    if spec.device.num_threads is None:
        torch.set_num_threads(max(1, usable_cpus() // spec.distributed.nproc_per_node))
    return torch.device(device_type)
