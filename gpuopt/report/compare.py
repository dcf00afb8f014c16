"""`python -m gpuopt.report --compare A B`: two trials side by side (config diff, metrics with B's
change against A, diagnoses, phase breakdowns). A and B are trial numbers of the study or paths to
a run's `result.json`, in any mix; plain data first (`Comparison`) so tests assert on the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, Group

from gpuopt.core.fmt import fixed
from gpuopt.core.fmt import metric as fmt
from gpuopt.core.result import TrialResult, result_user_attrs
from gpuopt.report.build import (
    COMPARED_METRICS,
    ConfigChange,
    ReportError,
    StudyReport,
    TrialView,
    config_diff,
    device_type_of,
)
from gpuopt.report.diagnose import diagnose
from gpuopt.report.evidence import PHASE_LABELS
from gpuopt.report.tables import change, rows_table, to_rich

GPU_SHARES = ("kernel", "memcpy", "idle", "host_wait", "kernel_wait")


# One side of a comparison: its label ("trial #5", or the result.json path) and the trial.
TrialSide = tuple[str, TrialView]


@dataclass
class PhaseRow:
    phase: str
    a_ms: float | None
    a_pct: float | None
    b_ms: float | None
    b_pct: float | None


@dataclass
class Comparison:
    labels: tuple[str, str]
    a: TrialView
    b: TrialView
    config_changes: list[ConfigChange]
    metrics: list[tuple[str, float | None, float | None]]  # name, A, B
    phases: list[PhaseRow] = field(default_factory=list)  # empty unless one side was profiled
    gpu: list[tuple[str, float | None, float | None]] = field(default_factory=list)


def side_from_result(path: Path) -> TrialSide:
    """A trial's result.json (as `python -m gpuopt.run` writes it)."""
    try:
        result = TrialResult.load(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ReportError(f"cannot read a trial result from {path}: {exc}") from None
    attrs, status = result_user_attrs(result), result.status.value
    device = device_type_of(attrs, None)
    diagnosis = diagnose(attrs, status=status, device_type=device, config=result.config)
    return str(path), TrialView(-1, status, None, {}, attrs, diagnosis)


def resolve_side(reference: str, report: StudyReport | None) -> TrialSide:
    """A trial number (needs the study's report) or a path to a result.json (or its run dir)."""
    if reference.isdigit():
        if report is None:
            raise ReportError(f"trial #{reference} needs a study (--storage, --study)")
        trial = report.trial(int(reference))
        return f"trial #{trial.number}", trial
    path = Path(reference)
    return side_from_result(path / "result.json" if path.is_dir() else path)


def _phase_rows(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[PhaseRow]:
    if a is None and b is None:
        return []

    def get(profile: dict[str, Any] | None, key: str, phase: str, scale: float) -> float | None:
        value = ((profile or {}).get(key) or {}).get(phase)
        return value * scale if isinstance(value, (int, float)) else None

    return [
        PhaseRow(
            phase,
            get(a, "phases_s", phase, 1e3),
            get(a, "phases_pct", phase, 1.0),
            get(b, "phases_s", phase, 1e3),
            get(b, "phases_pct", phase, 1.0),
        )
        for phase in PHASE_LABELS
    ]


def _gpu_rows(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[tuple[str, Any, Any]]:
    gpu_a, gpu_b = (a or {}).get("gpu"), (b or {}).get("gpu")
    if not isinstance(gpu_a, dict) and not isinstance(gpu_b, dict):
        return []
    return [(name, (gpu_a or {}).get(name), (gpu_b or {}).get(name)) for name in GPU_SHARES]


def compare(side_a: TrialSide, side_b: TrialSide) -> Comparison:
    """What differs between two trials: config keys, metrics, phases and GPU shares."""
    (label_a, a), (label_b, b) = side_a, side_b
    return Comparison(
        labels=(label_a, label_b),
        a=a,
        b=b,
        config_changes=config_diff(a.config, b.config) if a.config and b.config else [],
        metrics=[
            (name, a.metric(name), b.metric(name))
            for name in COMPARED_METRICS
            if a.metric(name) is not None or b.metric(name) is not None
        ],
        phases=_phase_rows(a.profile, b.profile),
        gpu=_gpu_rows(a.profile, b.profile),
    )


# -- rendering ------------------------------------------------------------------------------------
def _tables(c: Comparison) -> list[Any]:
    a, b = c.labels
    no_config = "(no difference)" if c.a.config and c.b.config else "(no config)"
    parts = [
        rows_table(
            "Config: what differs",
            ("key", a, b),
            [(i.key, repr(i.baseline), repr(i.best)) for i in c.config_changes]
            or [(no_config, "", "")],
            numbers=False,
        ),
        rows_table(
            "Metrics",
            ("metric", a, b, "B vs A"),
            [
                ("status", c.a.status, c.b.status, ""),
                *((n, fmt(n, va), fmt(n, vb), change(n, va, vb)) for n, va, vb in c.metrics),
            ],
        ),
    ]
    if c.phases:
        parts.append(
            rows_table(
                "Where the step goes (profiled window)",
                ("phase", f"{a} ms", f"{a} %", f"{b} ms", f"{b} %"),
                [
                    (
                        r.phase,
                        fixed(r.a_ms),
                        fixed(r.a_pct, digits=1),
                        fixed(r.b_ms),
                        fixed(r.b_pct, digits=1),
                    )
                    for r in c.phases
                ],
            )
        )
    if c.gpu:
        rows = [(name, fixed(va, digits=1), fixed(vb, digits=1)) for name, va, vb in c.gpu]
        parts.append(rows_table("GPU time (% of the profiled window)", ("share", a, b), rows))
    return [to_rich(part) for part in parts]


def render_comparison(c: Comparison, console: Console) -> None:
    from gpuopt.report.text import diagnosis_panel

    console.print(Group(*_tables(c)))
    for label, side in zip(c.labels, (c.a, c.b), strict=True):
        console.print(diagnosis_panel(label, side.diagnosis))
    if not c.phases:
        console.print(
            "[dim]No phase breakdown: neither trial was profiled (run it with profile=on).[/]"
        )
