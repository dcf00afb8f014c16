"""submitit's local job controller, also writing its tasks' exit codes (`<job_id>_exit_codes.json`)
next to the job's logs: a trial killed by a signal leaves no result pickle, and submitit's
controller keeps the status to itself, so fresh_process could not say "killed by signal SIGSEGV".
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from submitit.core.utils import JobPaths

from gpuopt.core._compat import local_controller_class
from gpuopt.sweeper.launchers.fresh_process import EXIT_CODES_SUFFIX


class ExitCodeController(local_controller_class()):  # type: ignore[misc]
    def wait(self, freq: int = 24) -> Any:
        codes = super().wait(freq)
        folder = JobPaths(self.folder, self.pid, 0).folder
        with contextlib.suppress(OSError):
            pids = [task.pid for task in self.tasks]
            record = {"codes": list(codes), "pids": pids}
            (folder / f"{self.pid}{EXIT_CODES_SUFFIX}").write_text(json.dumps(record))
        return codes


if __name__ == "__main__":
    assert len(sys.argv) == 2, (
        "Usage: python -m gpuopt.sweeper.launchers._controller <submitit_folder>"
    )
    ExitCodeController(Path(sys.argv[1])).run()
