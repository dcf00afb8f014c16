"""The report page (`python -m gpuopt.report --html`): its sections in reading order, offline and
self-contained, and, in a real headless Chromium (Debian's `chromium`), loaded without JavaScript
errors, its charts drawn (non-empty SVG), no horizontal scrolling at 1366 px, and a screenshot."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest

from gpuopt.report.build import build_report
from gpuopt.report.cli import main
from gpuopt.study.storage import load_study, open_existing
from tests.helpers.profile_studies import build_profiled_cpu_study
from tests.helpers.report_studies import confirmation_record, fast_storage_dir

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
LAPTOP_WIDTH = 1366
# Charts on the page for this study: the speedup interval, the phase bars, and the search's
# history, importances, parallel coordinates and throughput vs batch size.
CHARTS = 6


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Iterator[tuple[Path, str]]:
    """The page of the profiled CPU study with a confirmation round (best = #1, re-measured)."""
    with fast_storage_dir(tmp_path_factory.mktemp("page")) as folder:
        url = f"sqlite:///{folder / 'gpuopt.db'}"
        rdb = optuna.storages.RDBStorage(url)
        record = confirmation_record(same_training=True)  # (a) #9 and (b) #1 both confirmed
        build_profiled_cpu_study(rdb, study_attrs={"confirmation": record})
        rdb.remove_session()
        path = tmp_path_factory.mktemp("html") / "report.html"
        assert main(["--storage", url, "--html", str(path)]) == 0
        yield path, url


def test_sections_come_in_reading_order(page):
    text = page[0].read_text()
    headings = re.findall(r"<h2>(.*?)</h2>", text)
    assert headings == ["The answer", "Where the time goes", "The search", "Trials",
                        "Full text report"]  # fmt: skip


def test_answer_shows_the_confirmed_speedup_with_its_interval(page):
    path, url = page
    report = build_report(load_study(open_existing(url), url, None), url)
    entry = report.confirmation.comparison_of(1)
    text = path.read_text()
    assert report.best.number == 1
    assert f"{entry.ratio:.2f}x" in text
    assert f"95% CI {entry.ci_low:.2f}-{entry.ci_high:.2f}x" in text
    assert "Speedup over the baseline (re-measured, 95% CI)" in text
    assert "loader.batch_size=64 loader.num_workers=2" in text  # the change to apply
    assert "53% of the step in next(loader)" in text  # the baseline's diagnosis cites its phases


def test_the_answer_gives_both_answers_above_the_fold(page):
    """Issue 34: the page used to show only (b), batch 64 here, as "the change to apply", with
    nothing above the fold saying it changes the training. Now (a) and (b) each come with their
    interval and change to apply, (b) with what it changes, before any chart of the search."""
    path, url = page
    report = build_report(load_study(open_existing(url), url, None), url)
    text = path.read_text()
    answer = text[text.index("<h2>The answer</h2>") : text.index("<h2>Where the time goes</h2>")]
    assert report.same_training.number == 9 and report.best.number == 1
    for number, label in ((9, "(a) same training"), (1, "(b) best overall")):
        entry = report.confirmation.comparison_of(number)
        assert f"{label} (trial #{number})" in answer
        assert f"{entry.ratio:.2f}x" in answer
        assert f"95% CI {entry.ci_low:.2f}-{entry.ci_high:.2f}x" in answer
    assert "Change to apply: <code>loader.num_workers=2</code>" in answer  # (a)
    assert "Change to apply: <code>loader.batch_size=64 loader.num_workers=2</code>" in answer
    assert "Changes the training</b>: global batch 32 -&gt; 64 (x2)" in answer
    assert answer.index("(a) Same training") < answer.index("(b) Best overall")
    assert "trial #9 (a: same training)" in text and "trial #1 (b: best)" in text  # the chart


def test_throughput_vs_batch_ticks_are_the_batch_sizes(page):
    """A log axis with plotly's own ticks read "3 4 5 6 7 8 9 100 2": the ticks are the batches."""
    from gpuopt.report.charts import figures

    _, url = page
    study = load_study(open_existing(url), url, None)
    charts = dict(figures(study, build_report(study, url)))
    axis = charts["Throughput vs batch size, by precision"].layout.xaxis
    assert axis.type == "log" and list(axis.tickvals) == [32, 64, 128, 256]
    assert list(axis.ticktext) == ["32", "64", "128", "256"]


def test_phase_bars_show_baseline_and_best(page):
    text = page[0].read_text()
    assert "Profiled step, baseline vs best" in text
    for label in ("baseline #0", "best #1"):
        assert label in text
    for phase in ("next(loader)", "optimizer", "backward"):
        assert f'"name":"{phase}"' in text


def test_page_is_self_contained(page):
    text = page[0].read_text()
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", text)  # nothing fetched
    assert text.count("Plotly.newPlot") == CHARTS
    # plotly.js inlined once (its bundle starts with this banner), not per chart.
    assert text.count("plotly.js v") >= 1 and len(text) < 8_000_000


def test_trials_table_has_every_trial_and_sorts_by_number_value(page):
    text = page[0].read_text()
    table = text[text.index('<table class="trials">') :]
    assert table.count("<tr") == 1 + 11  # header + every trial
    assert 'data-value="2500' in table and "aria-sort" in text  # numbers sort by value


def _chromium(url: str, out: Path, extra: list[str]) -> tuple[str, str]:
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--enable-logging=stderr", "--v=0", f"--window-size={LAPTOP_WIDTH},900",
         "--virtual-time-budget=5000", *extra, "--dump-dom", url],
        capture_output=True, text=True, timeout=120, check=False, cwd=out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, proc.stderr


def _console(stderr: str) -> list[str]:
    """The page's console messages as Chromium logs them (errors, uncaught exceptions, logs)."""
    return [line for line in stderr.splitlines() if "CONSOLE" in line]


needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="needs Debian's chromium (apt-get install -y chromium)",
)


@needs_chromium
def test_console_check_catches_a_javascript_error(tmp_path):
    """The check below would see an error: a page that throws shows up in the console lines."""
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>notDefined();</script></body></html>")
    _, stderr = _chromium(bad.as_uri(), tmp_path, [])
    assert any("Uncaught ReferenceError" in line for line in _console(stderr))


@needs_chromium
def test_page_renders_in_headless_chromium(page, tmp_path):
    path = page[0]
    # A copy that writes the layout's width into the DOM once loaded (the product page has no
    # test hooks); Chromium loads it from disk with no network.
    probe = tmp_path / "probe.html"
    probe.write_text(
        path.read_text().replace(
            "</body>",
            "<script>window.addEventListener('load', function () {"
            "document.body.setAttribute('data-scroll-width', document.documentElement.scrollWidth);"
            "document.body.setAttribute('data-inner-width', window.innerWidth);});</script></body>",
        )
    )
    shot = tmp_path / "page.png"
    dom, stderr = _chromium(probe.as_uri(), tmp_path, [f"--screenshot={shot}"])
    assert _console(stderr) == []  # no JavaScript error, nor any other console message
    # Every chart drew: plotly's SVG with plotted content (paths), one per chart.
    svgs = re.findall(r'<svg class="main-svg".*?</svg>', dom, flags=re.S)
    drawn = [s for s in svgs if "<path" in s]
    charts = re.findall(r'<div class="chart">', dom)
    assert len(charts) == CHARTS and len(drawn) >= CHARTS
    assert dom.count('class="plot-container plotly"') == CHARTS
    scroll = int(re.search(r'data-scroll-width="(\d+)"', dom).group(1))
    inner = int(re.search(r'data-inner-width="(\d+)"', dom).group(1))
    assert inner == LAPTOP_WIDTH and scroll <= inner  # no horizontal scrolling on a laptop
    assert shot.stat().st_size > 20_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
