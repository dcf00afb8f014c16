"""Where a sweep's time went: its phases' wall time, logged and written to `timing.json`
(scripts/bench_time_to_answer.py reads it)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpuopt.core.fmt import duration

log = logging.getLogger("gpuopt.sweeper")

TIMING_FILE = "timing.json"


@dataclass
class PhaseClock:
    """Wall time per phase, in the order the sweep runs them (plan, trials, confirmation, ...)."""

    t0: float = field(default_factory=time.monotonic)
    phases: dict[str, float] = field(default_factory=dict)
    _last: float = 0.0

    def __post_init__(self) -> None:
        self._last = self.t0

    def lap(self, phase: str) -> None:
        """The time since the previous lap is `phase`'s."""
        now = time.monotonic()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def write(self, sweep_dir: Path, raced: bool) -> None:
        """timing.json ({"<phase>_s": s, "total_s": s, "raced": bool}) and one log line."""
        record = {f"{k}_s": round(v, 3) for k, v in self.phases.items()}
        record.update(total_s=round(self.elapsed(), 3), raced=raced)
        try:
            (sweep_dir / TIMING_FILE).write_text(json.dumps(record, indent=1) + "\n")
        except OSError as exc:
            log.warning("%s not written: %s", TIMING_FILE, exc)
        shown = ", ".join(f"{k} {duration(v)}" for k, v in self.phases.items())
        log.info("time: %s (%s)", shown, "raced in one process" if raced else "fresh processes")
