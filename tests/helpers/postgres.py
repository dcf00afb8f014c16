"""A real, throwaway PostgreSQL server for the tests that share one Optuna study between processes.

Debian's server binaries (`initdb`, `pg_ctl`) on a temporary data directory, listening on a free
loopback port only. PostgreSQL refuses to run as root, so as root the server runs as the `postgres`
system user. Tests that need it skip with the reason when the binaries are missing.

Logins are trusted (no password), except for members of the group role `PASSWORD_LOGIN`: over TCP
they must give their password (scram-sha-256, PostgreSQL's default encryption), so a test can
create `CREATE ROLE r LOGIN PASSWORD '...' IN ROLE password_login` and see a wrong one refused.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PASSWORD_LOGIN = "password_login"
# pg_hba.conf is read top down, first match wins: the group's lines go before initdb's trust lines.
_PASSWORD_HBA = (
    f"host all +{PASSWORD_LOGIN} 127.0.0.1/32 scram-sha-256\n"
    f"host all +{PASSWORD_LOGIN} ::1/128 scram-sha-256\n"
)


def find_pg_bin() -> Path | None:
    """The directory holding initdb and pg_ctl (PATH first, then Debian's versioned layout)."""
    on_path = shutil.which("initdb")
    if on_path:
        return Path(os.path.realpath(on_path)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    return Path(candidates[0]).parent if candidates else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _as_server_user(cmd: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return cmd
    pwd.getpwnam("postgres")  # KeyError: no user to run the server as
    return ["runuser", "-u", "postgres", "--", *cmd]


@contextmanager
def postgres_server(database: str = "gpuopt") -> Iterator[str]:
    """Start a server, create `database`, yield its SQLAlchemy URL, stop and delete it afterwards."""
    pg_bin = find_pg_bin()
    if pg_bin is None:
        raise FileNotFoundError("PostgreSQL server binaries (initdb, pg_ctl) not found")
    root = Path(tempfile.mkdtemp(prefix="gpuopt-pg-"))
    data, sock_dir = root / "data", root / "sock"
    sock_dir.mkdir()
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        for path in (root, sock_dir):
            os.chown(path, pw.pw_uid, pw.pw_gid)
    port = _free_port()

    def run(*cmd):
        return subprocess.run(
            _as_server_user([str(pg_bin / cmd[0]), *cmd[1:]]),
            check=True,
            capture_output=True,
            text=True,
        )

    try:
        # --no-sync: a throwaway cluster need not be on disk before its server starts (saves seconds
        # of fsync on this machine's disk)
        run("initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        hba = data / "pg_hba.conf"
        hba.write_text(_PASSWORD_HBA + hba.read_text())
        run(
            "pg_ctl",
            "-D",
            str(data),
            "-l",
            str(root / "server.log"),
            "-w",
            "-t",
            "60",
            "-o",
            f"-p {port} -k {sock_dir} -c listen_addresses=127.0.0.1 -c max_connections=100",
            "start",
        )
        run("createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", database)
        login = ("-h", "127.0.0.1", "-p", str(port), "-U", "postgres")
        run("createuser", *login, "--no-login", PASSWORD_LOGIN)
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/{database}"
    finally:
        subprocess.run(
            _as_server_user(
                [str(pg_bin / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"]
            ),
            capture_output=True,
        )
        # Give the postmaster a moment to release files before removing the directory.
        time.sleep(0.2)
        shutil.rmtree(root, ignore_errors=True)
