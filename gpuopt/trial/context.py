"""The per-trial context: one `Trial` object an engine fills as it measures, so a failure can
release what was built and the partial metrics and notes survive into the result. torch-free at
import. `Trial.phase` is the trial's phase clock (the result's `phases`, docs/measuring.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpuopt.core.result import Metrics
from gpuopt.core.spec import TrialSpec

if TYPE_CHECKING:
    import torch


@dataclass
class Trial:
    """Everything a trial holds, so failures can release it and partial metrics survive."""

    spec: TrialSpec
    device: torch.device
    metrics: Metrics = field(default_factory=Metrics)
    warnings: list[str] = field(default_factory=list)
    inspect: Callable[[str, Any], None] | None = None
    # What the engine built and must let go of at the trial's end (closed first where it has a
    # close()), so the device cache can be given back even after a failure.
    resources: list[Any] = field(default_factory=list)
    profile: dict[str, Any] | None = None  # the profiled window's summary
    # Steps run once the trial measured ok and released what it built (the numerics guard), in
    # order, by gpuopt.engines._lifecycle.run_measured. Each takes the trial and never raises.
    after_release: list[Callable[[Trial], None]] = field(default_factory=list)
    numerics: dict[str, Any] | None = None  # the numerics guard's evidence
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase, in first-run order

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase `name`, summed with earlier runs of it (also when it raises).
        Phases must not nest: they sum to the trial's wall time (run_measured adds `other`)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - started

    def show(self, name: str, obj: Any) -> None:
        """Hand a built object to the `inspect` hook of run_trial (tests, debugging)."""
        if self.inspect is not None:
            self.inspect(name, obj)
