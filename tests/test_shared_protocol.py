"""The sweeper <-> shared-process protocol (gpuopt/core/shared_protocol.py): every message survives
its JSON line, an answer with a reason is a Failure, the process answers what it cannot do, and a
window reads exactly the catalogue's window metrics."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gpuopt.core import metrics
from gpuopt.core import shared_protocol as protocol
from gpuopt.core.result import Status, TrialResult

COMMANDS = [
    protocol.Window("baseline"),
    protocol.Window(
        "#3", window_s=0.0, min_steps=10, deadline_s=0.2, settle=False, give_up_below=9.5
    ),
    protocol.Add("#3", "race/trial3.yaml", protocol.Steady(epoch_steps=8, data_wait=0.1)),
    protocol.Drop("#3"),
    protocol.Trial("#1", "race/trial1.yaml", "trial_1"),
]
READING = protocol.Reading("a", 10.0, 9.0, 3.2, steps=4, seconds=0.5, drained=1, command_s=0.6)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.op)
def test_every_command_survives_its_json_line(command) -> None:
    line = json.dumps(command.to_json())
    assert json.loads(line)["op"] == command.op
    assert protocol.parse_command(line) == command


@pytest.mark.parametrize("line", ["", "baseline", "[1]", '{"op": "nope"}', '{"op": "window"}'])
def test_a_line_that_is_no_command_is_a_value_error(line) -> None:
    with pytest.raises(ValueError):
        protocol.parse_command(line)


@pytest.mark.parametrize(
    "answer",
    [
        READING,
        protocol.Added("#3", {"loader": {"batch_size": 256}}),
        protocol.TrialDone("#1", TrialResult(status=Status.OOM, reason="CUDA out of memory")),
        protocol.Failure("#3", "diverged", "loss became NaN"),
    ],
    ids=lambda a: type(a).__name__,
)
def test_every_answer_survives_its_json_line(answer) -> None:
    data = json.loads(json.dumps(answer.to_json()))
    assert protocol.answer_from_json(data, type(answer)) == answer


def test_an_answer_with_a_reason_is_a_failure_and_a_malformed_one_an_error() -> None:
    failure = protocol.answer_from_json(
        {"label": "a", "status": "oom", "reason": "OOM"}, protocol.Reading
    )
    assert failure == protocol.Failure("a", "oom", "OOM")
    broken = protocol.answer_from_json({"label": "a", "status": "ok"}, protocol.Reading)
    assert isinstance(broken, protocol.Failure) and broken.status == "error"


def test_the_spec_file_survives_the_disk(tmp_path) -> None:
    spec = protocol.Spec(
        {"baseline": "baseline.yaml"}, 0.5, 3, {"baseline": protocol.Steady(8, 1.5)}
    )
    spec.write(tmp_path / "spec.json")
    assert protocol.Spec.read(tmp_path / "spec.json") == spec


def test_a_window_reads_the_catalogues_window_metrics_and_uses_its_trials_others() -> None:
    assert set(protocol.Reading.metrics()) == metrics.window_metrics()
    assert READING.value("step_time_ms") == 3.2 and READING.value("mfu") is None
    steady = {f.name for f in dataclasses.fields(protocol.Steady)}
    assert steady == set(metrics.names(window="uses"))


def test_the_process_answers_what_it_cannot_do(capsys) -> None:
    from gpuopt.processes.shared_windows import serve

    lines = ['{"op": "window", "label": "nobody"}', "baseline", '{"op": "drop", "label": "x"}']
    serve(protocol.Spec({}), lines)
    ready, *answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert ready == {"ready": []}
    got = [protocol.answer_from_json(a, protocol.Reading) for a in answers]
    assert [(a.label, a.status) for a in got] == [
        ("nobody", "error"),
        ("", "error"),
        ("x", "error"),
    ]
    assert "window: no configuration 'nobody'" in got[0].reason and "invalid" in got[1].reason
