"""The protocol between the sweeper and its shared measuring process
(`python -m gpuopt.processes.shared_windows SPEC.json`: the race's and the in-process
confirmation's), as typed messages both ends import (torch-free), so neither spells a key by hand.
The process reads a `Spec`, answers `Ready`, then one `Command` a line on stdin with one answer a
line on stdout (the command's own, or a `Failure`); stdin closed, it releases everything, exit 0.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from gpuopt.core.metrics import names
from gpuopt.core.result import Status, TrialResult

M = TypeVar("M", bound="Message")
Decoders = dict[str, Callable[[Any], Any]]


def _plain(value: Any) -> Any:
    """A field's JSON value: a nested message (or TrialResult) as its own object."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, TrialResult):
        return value.to_dict()
    return value.to_json() if isinstance(value, Message) else value


class Message:
    """One JSON object: the dataclass's fields by name (unknown keys ignored when read; a nested
    message's field read by its `nested` decoder)."""

    nested: ClassVar[Decoders] = {}

    def to_json(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_json(cls: type[M], data: dict[str, Any]) -> M:
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        kept = {k: v for k, v in data.items() if k in names}
        return cls(**{k: cls.nested[k](v) if k in cls.nested else v for k, v in kept.items()})


@dataclass
class Steady(Message):
    """What a configuration's own trial measured that its windows use (the catalogue's
    `window="uses"` metrics): its epoch boundary, to amortize each window as the trial did, and
    its data wait (a loader that kept up needs no drain of its queue before a window)."""

    epoch_steps: int | None = None
    epoch_overhead_s: float | None = None
    data_wait: float | None = None


@dataclass
class Spec(Message):
    """The spec file: label -> CONFIG.yaml (a composed task config, as the memory probe reads it);
    a window lasts `window_s` and at least `min_steps` optimizer steps unless its command says."""

    configs: dict[str, str]
    window_s: float = 1.0
    min_steps: int = 5
    steady: dict[str, Steady] = field(default_factory=dict)
    nested: ClassVar[Decoders] = {
        "steady": lambda steady: {k: Steady.from_json(v) for k, v in steady.items()}
    }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def read(cls, path: Path) -> Spec:
        return cls.from_json(json.loads(path.read_text()))


@dataclass
class Ready(Message):
    """The first line: every configuration built and warmed (one that failed to build answers
    its windows with its failure)."""

    ready: list[str]  # the labels


@dataclass
class Answer(Message):
    """An answer about one configuration: `status` (the command's), how long it took."""

    label: str
    _: KW_ONLY
    status: str = "ok"
    command_s: float | None = None


@dataclass
class Reading(Answer):
    """One window: samples/s, the same amortized over the trial's measured epoch boundary, the
    median optimizer step; its `steps`, `seconds`, the untimed steps `drained` before it, whether
    it was read on those (`Window.give_up_below`)."""

    throughput: float  # these three: the catalogue's window="reads" metrics
    throughput_amortized: float | None
    step_time_ms: float
    steps: int
    seconds: float
    drained: int = 0
    read_on_drain: bool = False

    @classmethod
    def metrics(cls) -> tuple[str, ...]:
        return names(window="reads")

    def value(self, metric: str) -> float | None:
        """The reading of `metric`, None where a window does not read it."""
        return getattr(self, metric) if metric in self.metrics() else None


@dataclass
class Added(Answer):
    """A configuration built and warmed: its spec as the study stores it."""

    config: dict[str, Any]


@dataclass
class TrialDone(Answer):
    """A configuration measured as a whole trial of the process (its result's own status)."""

    result: TrialResult
    nested: ClassVar[Decoders] = {"result": TrialResult.from_dict}


@dataclass
class Failure(Answer):
    """No answer but why: a TrialResult status ("oom", "diverged", "error") and its reason;
    "error" also for a command that names no configuration, or a process gone."""

    status: str = field()  # no default: not Answer's "ok"
    reason: str

    def result(self, config: dict[str, Any] | None = None) -> TrialResult:
        """The failed configuration's TrialResult (a status no trial has, "slow": an error)."""
        status = Status(self.status) if self.status in set(Status) else Status.ERROR
        return TrialResult(status=status, reason=self.reason, config=config or {})


A = TypeVar("A", bound=Answer)


def answer_from_json(data: dict[str, Any], expected: type[A]) -> A | Failure:
    """The process's answer to a command whose answer is `expected`, or its Failure."""
    try:
        return Failure.from_json(data) if "reason" in data else expected.from_json(data)
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        return Failure(str(data.get("label", "")), "error", f"unexpected answer {data}: {exc!r}")


@dataclass
class Command(Message):
    """One stdin line: its `op` is its class's name."""

    answer: ClassVar[type[Answer]] = Answer
    label: str

    @property
    def op(self) -> str:
        return type(self).__name__.lower()

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, **super().to_json()}


@dataclass
class Window(Command):
    """One window of `label` (None: the spec's length and steps), cut short at `deadline_s`;
    `settle` false: no wait for idle loader workers after it (a configuration dropped next);
    `give_up_below` (samples/s): a drain read slower right after the configuration's own steps
    ends the window, read on that drain (`Reading.read_on_drain`)."""

    answer: ClassVar[type[Answer]] = Reading
    window_s: float | None = None
    min_steps: int | None = None
    deadline_s: float | None = None
    settle: bool = True
    give_up_below: float | None = None


@dataclass
class Add(Command):
    """Build CONFIG.yaml `config` as `label`, warmed up (one it had released first)."""

    answer: ClassVar[type[Answer]] = Added
    config: str
    steady: Steady = field(default_factory=Steady)
    nested: ClassVar[Decoders] = {"steady": lambda steady: Steady.from_json(steady or {})}


@dataclass
class Drop(Command):
    """Release `label` (its loader workers stopped): answered Answer(label, status="dropped")."""


@dataclass
class Trial(Command):
    """Measure CONFIG.yaml `config` as a whole trial of the process (its window, extras and
    profile), result.json and the trace written into `run_dir`."""

    answer: ClassVar[type[Answer]] = TrialDone
    config: str
    run_dir: str


COMMANDS = {c.__name__.lower(): c for c in (Window, Add, Drop, Trial)}


def parse_command(line: str) -> Command:
    """One stdin line as its command; ValueError when it is none."""
    data = json.loads(line)
    kind = COMMANDS.get(data.get("op")) if isinstance(data, dict) else None
    if kind is None:
        raise ValueError(f"no command {line.strip()!r}")
    try:
        return kind.from_json(data)
    except (TypeError, KeyError) as exc:
        raise ValueError(f"{kind.__name__.lower()}: {exc}") from exc
