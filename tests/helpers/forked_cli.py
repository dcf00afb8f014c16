"""Many short runs of gpuopt's CLIs (`python -m gpuopt.run ...`, `python -m gpuopt.report ...`), each
in a process of its own, without each paying Python's start and the imports of Hydra, OmegaConf,
Optuna and gpuopt's torch-free modules (~0.5-1 s, most of a run that ends on bad input or reads a
study).

`CliForks.run` hands each run to a server process, started once per flavor: `no_torch` (torch made
unimportable, `sys.modules['torch'] = None`, as tests/test_bad_input.py's rows need) or not, and the
run's PYTHONPATH (it decides where the preloaded modules come from). A server imports those modules
once, never torch itself, then forks one child per run. The child takes the run's working directory
and environment, its stdin from /dev/null, its stdout and stderr into files, and runs the CLI module
as `__main__` with `runpy.run_module(..., alter_sys=True)` at the top level of `python -c`: an
exception or SystemExit ends it through the interpreter's own exit handling, which gives its exit
status. The module run as `__main__` is dropped from the child's preloaded modules first
(gpuopt.run, say): each child executes it afresh, with its own Hydra singletons; what needs torch
imports it in the child, as a fresh process would.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

# The server (argv[1]: "no_torch" or "torch"): preload, then one fork per request line on stdin;
# its replies are the child's pid, then its exit status. A child leaves the loop and runs the
# module below it, at the top level.
SERVER = r"""
import gc, importlib.util, json, os, runpy, sys
if sys.argv[1] == "no_torch":
    sys.modules["torch"] = None
import gpuopt.report.cli, gpuopt.run, gpuopt.sweeper.plugin  # noqa: E401
from hydra.core.plugins import Plugins
Plugins.instance()  # Hydra's plugin discovery: imports hydra_plugins.*
assert sys.modules.get("torch") is None, "the CLI server imported torch"
gc.collect()
gc.freeze()  # the children's collections skip what is preloaded (else each touches all of it)
channel = os.fdopen(os.dup(1), "w")
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        break
    channel.write(f"{pid}\n")
    channel.flush()
    _, status = os.waitpid(pid, 0)
    channel.write(f"{os.waitstatus_to_exitcode(status)}\n")
    channel.flush()
else:
    sys.exit(0)
channel.close()
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
    out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, fd)
    os.close(out)
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
module, *sys.argv = request["argv"]
sys.argv.insert(0, module)
main = module  # what runs as __main__: the module, or a package's __main__ submodule
if importlib.util.find_spec(module).submodule_search_locations is not None:
    main = f"{module}.__main__"
package, _, attr = main.rpartition(".")
if sys.modules.pop(main, None) is not None and hasattr(sys.modules[package], attr):
    delattr(sys.modules[package], attr)  # preloaded: the child runs it afresh as __main__
del line, request, pid, channel, null, fd, path, out, main, package, attr
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


class _Server:
    """One server process: `run` sends it a request and waits for the child's exit status."""

    def __init__(self, no_torch: bool, cwd: Path, env: Mapping[str, str]):
        self._process = subprocess.Popen(
            [sys.executable, "-c", SERVER, "no_torch" if no_torch else "torch"],
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._pending = b""

    def _reply(self, timeout: float, child: int | None = None) -> int:
        """The server's next line: the child's pid, then its exit status."""
        assert self._process.stdout is not None
        fd = self._process.stdout.fileno()
        while b"\n" not in self._pending:
            if not select.select([fd], [], [], timeout)[0]:  # timed out: end the child, the server
                if child is not None:
                    os.kill(child, signal.SIGKILL)
                self._process.kill()
                raise subprocess.TimeoutExpired(self._process.args, timeout)
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the CLI fork server ended (exit {self._process.wait()})")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return int(line)

    def run(self, request: dict, timeout: float) -> int:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(request).encode() + b"\n")
        self._process.stdin.flush()
        child = self._reply(timeout)
        return self._reply(timeout, child)

    def close(self) -> None:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        finally:
            if self._process.poll() is None:
                self._process.kill()
                self._process.wait()
            self._process.stdout.close()


class CliForks:
    """`run(module, argv, cwd, env)` -> a CompletedProcess (exit status, stdout, stderr) of
    `python -m module *argv` run in `cwd` with exactly `env` (`no_torch`: torch unimportable).
    `scratch`: a folder for the servers and the children's output files, outside any folder a
    test watches."""

    def __init__(self, scratch: Path):
        self._scratch = scratch
        self._servers: dict[tuple[bool, str | None], _Server] = {}
        self._count = 0

    def run(
        self,
        module: str,
        argv: Sequence[str],
        cwd: Path,
        env: Mapping[str, str],
        no_torch: bool = False,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        flavor = (no_torch, env.get("PYTHONPATH"))
        if flavor not in self._servers:
            self._servers[flavor] = _Server(no_torch, self._scratch, env)
        self._count += 1
        out, err = (self._scratch / f"{self._count}.{name}" for name in ("out", "err"))
        request = {
            "argv": [module, *argv],
            "cwd": str(cwd),
            "env": dict(env),
            "stdout": str(out),
            "stderr": str(err),
        }
        try:
            status = self._servers[flavor].run(request, timeout)
        except (subprocess.TimeoutExpired, RuntimeError):
            self._servers.pop(flavor).close()  # the next run starts a server afresh
            raise
        return subprocess.CompletedProcess(
            [sys.executable, "-m", module, *argv], status, out.read_text(), err.read_text()
        )

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
        self._servers.clear()
