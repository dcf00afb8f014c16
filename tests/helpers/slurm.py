"""A real, throwaway single-node SLURM cluster for the tests that submit sweeps' trials as jobs.

Debian's `slurm-wlm` and `munge` (apt-get install -y slurm-wlm munge): a munge key and daemon,
a slurm.conf for this one host (its hostname, CPUs, ~90% of its memory), slurmctld and slurmd in the
foreground on free ports, all state, spool, logs and sockets in a temporary directory, nothing in
/etc. Clients find the cluster through SLURM_CONF (and the munge socket named in it), which the
sweep's environment carries into sbatch and the jobs. No accounting storage (slurmdbd needs a
MySQL/MariaDB server): `sacct` answers "accounting storage is disabled", as on small clusters.
No cgroups (proctrack/linuxproc, task/none), so it also runs in containers.

Slurm's daemons must run as root here (slurmd launches jobs as their users); tests that need the
cluster skip with the reason when the binaries are missing or this is not root.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "slurmstepd", "sbatch", "squeue", "sinfo", "srun")
READY_S = 60.0


@dataclass(frozen=True)
class SlurmCluster:
    """One running cluster: the config clients need, and where its logs are."""

    conf: Path
    node: str
    root: Path

    @property
    def env(self) -> dict[str, str]:
        """Environment additions for a process that submits to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def logs(self) -> str:
        """The daemons' logs, for a failing test's message."""
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)


def missing() -> str | None:
    """Why the cluster cannot start here (None: it can)."""
    absent = [b for b in BINARIES if shutil.which(b) is None]
    if absent:
        return f"SLURM binaries not found ({', '.join(absent)}): apt-get install -y slurm-wlm munge"
    if os.geteuid() != 0:
        return "slurmd must run as root to launch jobs"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _memory_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def slurm_conf(root: Path, node: str, cpus: int, memory_mb: int, ports: tuple[int, int]) -> str:
    """A minimal slurm.conf for one host; KillWait=2 so a time-limited job dies 2 s after SIGTERM."""
    return "\n".join(
        [
            "ClusterName=gpuopt-test",
            f"SlurmctldHost={node}(127.0.0.1)",
            "SlurmUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root / 'munge.socket'}",
            f"SlurmctldPort={ports[0]}",
            f"SlurmdPort={ports[1]}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "KillWait=2",
            "OverTimeLimit=0",
            "InactiveLimit=0",
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN",
            f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def _wait_idle(cluster: SlurmCluster, daemons: list[subprocess.Popen[bytes]]) -> None:
    env = {**os.environ, **cluster.env}
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        for proc in daemons:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited ({proc.returncode})\n{cluster.logs()}")
        out = subprocess.run(
            ["sinfo", "-h", "-n", cluster.node, "-o", "%t"], env=env, capture_output=True, text=True
        )
        if out.stdout.strip() == "idle":
            return
        time.sleep(0.5)
    raise TimeoutError(f"node {cluster.node} not idle after {READY_S:g} s\n{cluster.logs()}")


def _leftovers(cluster: SlurmCluster) -> list[int]:
    """Live processes of this cluster: a command line naming its directory (the daemons; what
    `pgrep -f` matches) or its SLURM_CONF in their environment (slurmstepd, the jobs' processes)."""
    marker = f"SLURM_CONF={cluster.conf}".encode()
    pgrep = subprocess.run(["pgrep", "-f", str(cluster.root)], capture_output=True, text=True)
    pids = {int(p) for p in pgrep.stdout.split()} - {os.getpid()}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with suppress(OSError):
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                pids.add(int(entry.name))
    return sorted(pid for pid in pids if not _zombie(pid))


def _zombie(pid: int) -> bool:
    """An exited process its (new) parent has not reaped yet: no longer running, nothing to stop."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except (OSError, IndexError):
        return True  # gone


def _cancel_all(cluster: SlurmCluster) -> None:
    """scancel every job; wait (15 s at most) until no job runs and no slurmstepd is left."""
    env = {**os.environ, **cluster.env}
    subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True, timeout=30)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["squeue", "-h", "-t", "PD,R,CG,S", "-o", "%i"], env=env, capture_output=True, text=True
        )
        if out.returncode != 0 or not out.stdout.strip():
            return
        time.sleep(0.5)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextmanager
def slurm_cluster() -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and slurmd; yield the cluster once its node is idle; stop them all
    (every job cancelled, no process of it left: AssertionError if one is) and delete the files."""
    reason = missing()
    if reason:
        raise FileNotFoundError(reason)
    root = Path(tempfile.mkdtemp(prefix="gpuopt-slurm-"))
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir()
    node = socket.gethostname().split(".")[0]
    cpus = len(os.sched_getaffinity(0))
    conf = root / "slurm.conf"
    conf.write_text(
        slurm_conf(root, node, cpus, int(_memory_mb() * 0.9), (_free_port(), _free_port()))
    )
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    cluster = SlurmCluster(conf=conf, node=node, root=root)
    env = {**os.environ, **cluster.env}
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        # --force: the socket's directory is under /tmp (world-writable), which munged distrusts.
        munged = [
            "munged", "--foreground", "--force", f"--key-file={key}",
            f"--socket={root / 'munge.socket'}", f"--pid-file={root / 'munged.pid'}",
            f"--log-file={root / 'log' / 'munged.log'}", f"--seed-file={root / 'munged.seed'}",
        ]  # fmt: skip
        with open(root / "log" / "munged.out", "wb") as out:
            daemons.append(subprocess.Popen(munged, env=env, stdout=out, stderr=out))
        deadline = time.monotonic() + 10
        while not (root / "munge.socket").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        for cmd in (["slurmctld", "-D", "-i"], ["slurmd", "-D", "-N", node]):
            with open(root / "log" / f"{cmd[0]}.out", "wb") as out:
                daemons.append(
                    subprocess.Popen([*cmd, "-f", str(conf)], env=env, stdout=out, stderr=out)
                )
        _wait_idle(cluster, daemons)
        yield cluster
    finally:
        if len(daemons) == 3:
            _cancel_all(cluster)
        for proc in reversed(daemons):  # slurmd, slurmctld, then munged
            _stop(proc)
        left = _wait_gone(cluster)
        for pid in left:  # only processes of this cluster (see _leftovers)
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"processes of the SLURM cluster left behind: {left}"


def _wait_gone(cluster: SlurmCluster, timeout_s: float = 10.0) -> list[int]:
    """The cluster's processes still alive after `timeout_s` (slurmstepd ends on its own)."""
    deadline = time.monotonic() + timeout_s
    while (left := _leftovers(cluster)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
