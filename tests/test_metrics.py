"""The metric catalogue (gpuopt.core.metrics): one record per metric, and what derives from it."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest

from gpuopt.core import metrics
from gpuopt.core.metrics import METRICS, Metrics

MEASURING = Path(__file__).resolve().parents[1] / "docs" / "measuring.md"


def test_docs_measuring_holds_the_catalogues_table_as_generated():
    text = MEASURING.read_text(encoding="utf-8")
    assert metrics.docs_table() in text, (
        "docs/measuring.md's metric table differs from the catalogue: replace it with the output "
        "of `python -m gpuopt.core.metrics`"
    )


def test_every_metrics_field_is_one_catalogue_record_of_its_name():
    fields = dataclasses.fields(Metrics)
    assert [m.name for m in METRICS] == [f.name for f in fields]
    for f in fields:
        assert f.default is None and str(f.type).endswith("| None"), f.name
        assert metrics.metric(f.name).meaning, f"{f.name}: no meaning for the docs"


@pytest.mark.parametrize("place", ["run", "compared", "column", "page"])
def test_each_place_orders_its_metrics_without_ties(place: str):
    at = [w if isinstance(w := getattr(m, place), int) else w.at for m in metrics._placed(place)]
    assert at and len(set(at)) == len(at), f"{place}: two metrics at one place {at}"


def test_what_a_window_reads_is_an_objective_and_the_screen_ranks_on_a_window_reading():
    reads = metrics.window_metrics()
    assert reads and all(name in metrics.goals() for name in reads)
    for name in reads:
        assert (metrics.metric(name).screen or name) in reads
    assert all(not m.screen or m.window == "reads" for m in METRICS)


def test_lookups_answer_for_names_outside_the_catalogue():
    assert "val_acc" not in metrics.goals() and metrics.unit("val_acc") == ""
    assert metrics.goals()["step_time_ms"] == "minimize"
    assert metrics.unit("throughput") == "samples/s"
    with pytest.raises(KeyError):
        metrics.metric("val_acc")


def test_single_run_table_labels_are_unique():
    labels = Counter(row.label for _, row in metrics.run_rows())
    assert all(n == 1 for n in labels.values()), labels
