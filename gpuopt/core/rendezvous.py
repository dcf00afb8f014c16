"""Where the ranks of a job on several nodes (or SLURM tasks) meet, from SLURM's environment: the
job's first node and one port per job, computed alike by every task (no task tells the others).
Stdlib only.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping

# MASTER_PORT = PORT_BASE + job id % PORT_SPAN: above the well-known and registered ports most
# services bind, below Linux's ephemeral range (32768+), where a peer's outgoing port could be.
PORT_BASE, PORT_SPAN = 20000, 10000


def rendezvous_port(job_id: str) -> int:
    """The job's rendezvous port: the same on every task of the job, different for the next job."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return PORT_BASE + int(digits) % PORT_SPAN


def first_host(nodelist: str) -> str:
    """The first node of a SLURM node list (`node[3-5,9],gpu7` -> node3): `scontrol show
    hostnames` where it answers, else the list read as SLURM writes it."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.split()  # fmt: skip
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    head = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if head is None:
        return nodelist
    first = (head.group(2) or "").split(",")[0].split("-")[0]
    return head.group(1) + first


def slurm_rank_env(env: Mapping[str, str]) -> dict[str, str]:
    """The env:// variables of this task's rank, from SLURM's (empty outside a multi-task job)."""
    tasks = int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1")))
    if tasks < 2 or "SLURM_PROCID" not in env:
        return {}
    nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "localhost"
    per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0] or str(tasks)
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": str(tasks),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": per_node,
        "NODE_RANK": env.get("SLURM_NODEID", "0"),
        "MASTER_ADDR": first_host(nodes),
        "MASTER_PORT": str(rendezvous_port(env.get("SLURM_JOB_ID", "0"))),
    }


def slurm_endpoint(env: Mapping[str, str]) -> str | None:
    """`host:port` of the rendezvous of the SLURM job this process runs in (None outside one)."""
    if "SLURM_JOB_ID" not in env:
        return None
    nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "localhost"
    return f"{first_host(nodes)}:{rendezvous_port(env['SLURM_JOB_ID'])}"
