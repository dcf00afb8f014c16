"""A finalist read over the baseline before its whole trial, and its whole trial told as read so.

Why: a whole trial is one long window at a time of its own, and a shared machine's speed moves
from one second to the next (gpuopt/sweeper/comparison.py): the baseline's configuration measured again
as a whole trial in the race process read 0.76-1.20x its first (A/A, docs/benchmarks.md), so a
real 1.3x finalist could read 0.87x and be taken for no answer. So each finalist is first read
over the baseline in 4x the screen's windows (the screen's executor with a longer turn:
`read_over_baseline`); one that reads below `race.floor` is pruned there, without a whole trial.
The others run their whole trial (profile, compute ceiling, numerics guard, FLOPs), whose window
metrics are told as the baseline's whole-trial value x the paired ratio (`over_baseline`): the
finalists of a race are then read in one frame, the baseline's, and the whole trial's own
window reading is kept beside them (its `race` user attr, `whole_window`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpuopt.core import metrics
from gpuopt.core.result import TrialResult
from gpuopt.core.shared_protocol import Reading
from gpuopt.core.stats import Speedup
from gpuopt.sweeper.race import screen
from gpuopt.sweeper.race.process import RaceProcess
from gpuopt.sweeper.race.screen import Turn

# A finalist's windows in its read over the baseline, per screening window of race.slices (of
# race.window_s each; a candidate of long steps gets fewer, to as many windows' seconds): 20
# windows, 2 s, by default, against the screen's 5.
FINAL_SLICES_PER_SCREEN_SLICE = 4


@dataclass
class Paired:
    """A finalist's read over the baseline: its paired speedup on each window metric (> 1:
    better), over the round's control build's (`control`, the screen's calibration) where one
    was read; its turn (windows, build)."""

    speedups: Mapping[str, Speedup | None]
    turn: Turn | None
    control: float | None = None

    def ratio(self, metric_name: str) -> float | None:
        speedup = self.speedups.get(metric_name)
        if speedup is None:
            return None
        return speedup.ratio / self.control if self.control else speedup.ratio

    def to_json(self) -> dict[str, Any]:
        """What the study keeps: each metric's ratio, its 95% interval and pairs."""
        out: dict[str, Any] = {"windows": len(self.turn.slices) if self.turn else 0}
        for name, speedup in self.speedups.items():
            if speedup is None:
                continue
            scale = self.control or 1.0
            low, high = speedup.ci_low, speedup.ci_high
            out[name] = {
                "ratio": speedup.ratio / scale,
                "ci": None if low is None or high is None else [low / scale, high / scale],
                "pairs": speedup.n_pairs,
            }
        return out


def read_over_baseline(
    race: RaceProcess,
    label: str,
    config: Path,
    objective: str,
    options: Any,
    restart: Callable[[], RaceProcess],
    control: float | None,
) -> tuple[Paired, RaceProcess]:
    """`config` built as `label`, read in FINAL_SLICES_PER_SCREEN_SLICE x race.slices
    windows each between two of the baseline's, dropped; the read, and the race process it
    ended in."""
    slices = FINAL_SLICES_PER_SCREEN_SLICE * options.slices
    compared, windows = screen.screen(
        race, {label: config}, objective, options, restart, lambda *_: None, slices, give_up=False
    )
    speedups = {m: screen.window_ratio(compared, label, m) for m in Reading.metrics()}
    return Paired(speedups, windows.turns.get(label), control), windows.race


def over_baseline(
    result: TrialResult, baseline: Mapping[str, Any], paired: Paired
) -> tuple[TrialResult, dict[str, float]]:
    """`result` with each window metric the baseline's whole-trial value x the paired ratio
    (divided where lower is better); and the whole trial's own readings of those it replaced."""
    told: dict[str, float] = {}
    own: dict[str, float] = {}
    for name in Reading.metrics():
        base, measured, ratio = (
            baseline.get(name),
            getattr(result.metrics, name),
            paired.ratio(name),
        )
        if measured is None or not isinstance(base, (int, float)) or not ratio:
            continue
        higher_is_better = (metrics.metric(name).goal or metrics.MAX) == metrics.MAX
        told[name] = base * ratio if higher_is_better else base / ratio
        own[name] = measured
    return replace(result, metrics=replace(result.metrics, **told)), own
