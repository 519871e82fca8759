"""The self-contained HTML report, opened in a real headless browser (Debian's chromium, driven by Selenium through
Debian's chromedriver): no console error, no network request, every chart and table row it should have, and a
sortable table; and looked at, as a screenshot of a 1400 px window: nothing wider than the window, no figure blank.
Made from real runs: dense and MoE training (one profiled), three batch sizes, two load points of a streaming
server. The figures that answer "which configuration" are also checked on made-up runs (no browser)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmadapt import Workload, run
from llmadapt.analysis.htmlreport import build, collect, report
from llmadapt.errors import LlmadaptError
from llmadapt.host import free_port
from llmadapt.testing import environments_unready

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).parent
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
SMALL = ["train.seq_len=32", "train.micro_batch=2", "train.steps=4", "train.warmup_steps=1", "telemetry.interval_s=0"]

pytestmark = pytest.mark.skipif(bool(environments_unready("torch")), reason=environments_unready("torch") or "")


def train(preset: str, *extra: str) -> Workload:
    return Workload.from_file(ROOT / "examples" / f"{preset}.toml").with_overrides([*SMALL, *extra])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Seven runs: tiny-llama at global batch 4 (profiled), 8 and 16, tiny-mixtral, the plain adapter, and the load
    generator against a streaming test server at two request rates. The report reads run folders, however their
    runs were launched: the training runs are made in this process (inline), which spares five workers' starts."""
    out = tmp_path_factory.mktemp("runs")
    assert run(train("tiny-llama", "train.global_batch=4", "profile.steps=[2]", "profile.level=operator"), "torch",
               out=out, launcher="inline").ok
    for batch in (8, 16):
        assert run(train("tiny-llama", f"train.global_batch={batch}"), "torch", out=out, launcher="inline").ok
    assert run(train("tiny-mixtral", "train.global_batch=4", "eval.examples=4"), "torch", out=out,
               launcher="inline").ok
    if not environments_unready("plain"):
        assert run(train("tiny-llama", "train.global_batch=4"), "plain", out=out, launcher="inline").ok
    port = free_port()
    server = subprocess.Popen([sys.executable, str(HERE / "fake_openai.py"), str(port), "--first-ms", "5",
                               "--token-ms", "2"])
    try:
        for _ in range(400):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        for rate in (20.0, 60.0):
            serve = Workload.from_dict({"kind": "serve", "model": {"preset": "tiny-llama"}, "serve": {
                "url": f"http://127.0.0.1:{port}", "requests": 30, "warmup_requests": 1, "input_len": {"mean": 16},
                "output_len": {"mean": 8}, "arrival": {"process": "constant", "rate": rate}}})
            assert run(serve, "openai", out=out).summary.serving is not None
    finally:
        server.kill()
        server.wait()
    return out


EXPECTED_CHARTS = {"headline", "loss", "step_time", "memory", "breakdown_modules", "breakdown_operators",
                   "breakdown_module_operators", "expert_load",
                   "evaluation", "eval_expert_load", "latency_cdf", "latency_vs_load", "throughput_vs_latency",
                   "throughput_vs_batch"}


def test_the_report_holds_the_table_and_every_figure_its_runs_have(runs, tmp_path):
    folders = collect([runs])
    text, figures, comparison = build(folders)
    assert set(figures) == EXPECTED_CHARTS  # no estimate: this CPU is not in the device catalog
    assert text.count('<figure class="chart"') == len(EXPECTED_CHARTS)
    absolute, share = visible(figures["breakdown_modules"][1])  # ms per step, and each row's step as 100%
    assert share.get_xlim() == (0, 100) and absolute.get_xlim()[1] > 0
    assert "vs first</th>" in text
    for forbidden in ("<link", "src=\"http", "src='http", "@import", "url(http"):
        assert forbidden not in text, forbidden
    path = report([runs], tmp_path / "report.html", figures_dir=tmp_path / "figs")
    assert path.read_text() and sorted(p.name for p in (tmp_path / "figs").iterdir()) == sorted(
        f"{name}{suffix}" for name in EXPECTED_CHARTS for suffix in (".png", ".svg"))
    # every problem and layout its row: three batch sizes, MoE, (plain), two load points
    assert len(comparison.rows) == (7 if not environments_unready("plain") else 6)


def test_a_known_device_adds_the_estimate_against_the_measurement(runs, tmp_path, monkeypatch):
    """With this CPU described in a user catalog (as `llmadapt micro peak --save` would), the report sets the
    analytical estimate of each training run against its measured step time."""
    from llmadapt.analysis.report import read_summary

    name = read_summary(next(p for p in runs.iterdir() if "torch" in p.name))["device"]["name"]
    catalog = tmp_path / "devices.toml"
    catalog.write_text(f'[devices.this-cpu]\nkind = "cpu"\nmatch = ["{name}"]\nmemory_bytes = 24e9\n'
                       'memory_bandwidth = 20e9\npeak_flops = { fp32 = 100e9, bf16 = 100e9 }\n')
    monkeypatch.setenv("LLMADAPT_DEVICES", str(catalog))
    _, figures, _ = build(collect([runs]))
    assert "estimate_vs_measured" in figures


def test_bad_report_inputs_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    for args, message in (([tmp_path / "empty"], "is not a run folder nor a folder of runs"),
                          ([tmp_path / "missing"], "is not a run folder")):
        with pytest.raises(LlmadaptError, match=message):
            collect(args)
    out = subprocess.run([sys.executable, "-m", "llmadapt.cli", "report", str(tmp_path / "empty"), "-o",
                          str(tmp_path / "r.html")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and not (tmp_path / "r.html").exists()


def chromium(tmp_path: Path, width: int = 1400, height: int = 900):
    """Debian's headless chromium through Selenium, its window WIDTH px wide."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--hide-scrollbars", f"--window-size={width},{height}",
                 f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


needs_chromium = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                                    reason="needs Debian's chromium and chromium-driver (.ci/run installs them)")


@needs_chromium
def test_the_report_opens_in_headless_chromium_without_errors_or_network(runs, tmp_path):
    from selenium.webdriver.common.by import By

    path = report([runs], tmp_path / "report.html")
    driver = chromium(tmp_path)
    try:
        driver.get(path.as_uri())
        assert driver.title == "llmadapt report"
        charts = driver.find_elements(By.CSS_SELECTOR, "figure.chart svg")
        assert len(charts) == len(EXPECTED_CHARTS)
        assert all(c.size["width"] > 100 and c.size["height"] > 100 for c in charts)  # drawn, not empty
        rows = driver.find_elements(By.CSS_SELECTOR, "#comparison tbody tr")
        assert len(rows) == (5 if not environments_unready("plain") else 4)  # training; serving has its own
        assert len(driver.find_elements(By.CSS_SELECTOR, "#comparison-serve tbody tr")) == 2
        # Sorting: a click on a heading orders the rows by that column, a second click the other way
        head = [h for h in driver.find_elements(By.CSS_SELECTOR, "#comparison th") if h.text == "run"][0]
        head.click()
        labels = [r.find_elements(By.TAG_NAME, "td")[1].text for r in
                  driver.find_elements(By.CSS_SELECTOR, "#comparison tbody tr")]
        assert labels == sorted(labels), labels
        head.click()
        labels = [r.find_elements(By.TAG_NAME, "td")[1].text for r in
                  driver.find_elements(By.CSS_SELECTOR, "#comparison tbody tr")]
        assert labels == sorted(labels, reverse=True), labels
        errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
        assert errors == [], errors
        import json

        requests = [json.loads(e["message"])["message"] for e in driver.get_log("performance")]
        urls = [m["params"]["request"]["url"] for m in requests if m["method"] == "Network.requestWillBeSent"]
        # the page itself and the browser's own pages (chrome://, before it): nothing over a network
        assert path.as_uri() in urls and not [u for u in urls if u.startswith(("http:", "https:", "ws:", "wss:"))]
    finally:
        driver.quit()


@needs_chromium
def test_the_report_fits_a_1400_px_window_and_every_figure_shows_in_a_screenshot(runs, tmp_path):
    """Looked at, not only parsed: in a 1400 px window nothing is wider than the window (the page does not scroll
    sideways, no table is cut off in its wrapper), the headline sits beside the table's 'vs first' column, and
    screenshots of the page and of every figure, as chromium drew them, are not blank."""
    import io

    from PIL import Image
    from selenium.webdriver.common.by import By

    path = report([runs], tmp_path / "report.html")
    driver = chromium(tmp_path, 1400)
    try:
        driver.get(path.as_uri())
        width = driver.execute_script("return window.innerWidth")
        assert width == 1400
        assert driver.execute_script("return document.documentElement.scrollWidth") <= width
        for table in driver.find_elements(By.CSS_SELECTOR, "table"):
            assert table.rect["x"] >= 0 and table.rect["x"] + table.rect["width"] <= width, table.get_attribute("id")
            wrapper = driver.execute_script("return arguments[0].parentElement", table)
            assert wrapper.get_property("scrollWidth") <= wrapper.get_property("clientWidth"), table.get_attribute("id")
        heads = [h.text.replace("\n", " ") for h in driver.find_elements(By.CSS_SELECTOR, "#comparison th")]
        assert heads.index("vs first") == heads.index("step p50 s") + 1, heads
        assert "vs first" in [h.text for h in driver.find_elements(By.CSS_SELECTOR, "#comparison-serve th")]
        if not environments_unready("plain"):  # P1 has two rows (torch, plain): a verdict, in both places
            assert driver.find_elements(By.CSS_SELECTOR, "#verdict-tables li")
            assert driver.find_elements(By.CSS_SELECTOR, "#headline figcaption li")
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1400, height + 200)
        page = Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("RGB")
        page.save(tmp_path / "report-1400.png")
        assert page.width == 1400 and len(page.getcolors(1 << 24)) > 500  # tables, text and colour, not blank
        figures = driver.find_elements(By.CSS_SELECTOR, "figure.chart")
        assert {f.get_attribute("id") for f in figures} == EXPECTED_CHARTS
        for figure in figures:
            svg = figure.find_element(By.TAG_NAME, "svg")
            assert svg.rect["x"] >= 0 and svg.rect["x"] + svg.rect["width"] <= width, figure.get_attribute("id")
            shot = Image.open(io.BytesIO(svg.screenshot_as_png)).convert("RGB")
            colours = shot.getcolors(1 << 24)  # (pixels, colour) of every colour drawn
            inked = sum(n for n, c in colours if min(c) < 200) / (shot.width * shot.height)
            assert shot.width > 300 and len(colours) > 30 and inked > 0.02, (figure.get_attribute("id"),
                                                                               len(colours), inked)
    finally:
        driver.quit()


# -- the figures that answer "which configuration", on made-up runs ---------------------------------------------
def made_up(label: str, *overrides: str, problem: str = "P1", losses=None, seconds=None, samples_per_s=100.0,
            preset: str = "tiny-llama"):
    from llmadapt.analysis.figures import ReportRun

    w = train(preset, *overrides)
    seconds = seconds or [0.02] * 4
    records = [{"type": "step", "step": i, "seconds": s, "rank": 0, "warmup": i < 1} for i, s in enumerate(seconds)]
    summary = {"adapter": "torch", "status": "ok", "losses": losses or [6.0, 5.9, 5.8, 5.7],
               "samples_per_s": {"mean": samples_per_s}}
    return ReportRun(label, Path("/nonexistent"), w, summary, records, problem=problem)


def visible(fig) -> list:
    return [ax for ax in fig.axes if ax.get_visible()]


def test_loss_curves_say_when_runs_coincide_and_never_mix_problems():
    from llmadapt.analysis.figures import close
    from llmadapt.analysis.figures_train import loss_curves

    same = [made_up(f"torch dp{i}", losses=[6.0 + i * 4.8e-8, 5.9, 5.8, 5.7]) for i in range(10)]
    apart = [made_up("torch", problem="P2", losses=[6.0, 5.9, 5.8, 5.7]),
             made_up("megatron", problem="P2", losses=[6.0, 5.8, 5.6, 5.4])]
    fig = loss_curves(same + apart)
    try:
        first, second = visible(fig)
        assert first.get_title(loc="left") == "P1: 10 runs agree within 4.3e-07" and len(first.lines) == 1
        assert second.get_title(loc="left").startswith("P2: 2 runs differ by up to")
        assert len(second.lines) == 2 and len({line.get_linestyle() for line in second.lines}) == 2
    finally:
        close(fig)


def test_step_times_are_small_multiples_for_many_runs_and_one_axis_with_the_legend_outside_for_few():
    from llmadapt.analysis.figures import close
    from llmadapt.analysis.figures_train import step_times

    many = step_times([made_up(f"run {i}", seconds=[0.03, 0.02, 0.021, 0.019]) for i in range(10)])
    few = step_times([made_up(f"run {i}", seconds=[0.03, 0.02, 0.2, 0.019]) for i in range(3)])
    try:
        assert len(visible(many)) == 10 and {ax.get_title() for ax in visible(many)} == {f"run {i}" for i in range(10)}
        (ax,) = visible(few)
        assert ax.get_yscale() == "log"  # 19 to 200 ms: a factor of ten
        few.canvas.draw()
        assert ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1  # beside the data, not on it
    finally:
        close(many)
        close(few)


def test_the_eq2_fit_is_drawn_only_over_runs_that_differ_in_batch_alone():
    from llmadapt.analysis.figures import close
    from llmadapt.analysis.figures_train import throughput_vs_batch

    mixed = [made_up("a", "train.global_batch=4"), made_up("b", "train.global_batch=8", "train.seq_len=64"),
             made_up("c", "train.global_batch=16", "optimizations.recompute=full")]
    assert throughput_vs_batch(mixed) is None  # three batch sizes, but each also changes something else
    batch = [made_up("a", f"train.global_batch={b}", samples_per_s=q) for b, q in ((4, 100), (8, 140), (16, 170))]
    fig = throughput_vs_batch(batch + mixed[1:])
    try:
        (ax,) = visible(fig)
        labels = ax.get_legend_handles_labels()[1]
        assert len([x for x in labels if x.startswith("Eq. 2 fit")]) == 1 and "torch dp1 tiny-llama (3 runs)" in labels
    finally:
        close(fig)


def test_each_series_over_batch_is_named_by_what_sets_it_apart():
    """Two sparsities of one MoE model, three batch sizes each: two series, each naming its experts per token."""
    from llmadapt.analysis.figures import close
    from llmadapt.analysis.figures_train import throughput_vs_batch

    runs = [made_up("torch dp1", f"train.global_batch={b}", f"model.experts_per_token={k}", preset="tiny-mixtral",
                    samples_per_s=100.0 * b / k) for k in (2, 4) for b in (4, 8, 16)]
    fig = throughput_vs_batch(runs)
    try:
        (ax,) = visible(fig)
        series = [x for x in ax.get_legend_handles_labels()[1] if x.endswith("runs)")]
        assert series == ["torch dp1 tiny-mixtral experts_per_token=2 (3 runs)",
                          "torch dp1 tiny-mixtral experts_per_token=4 (3 runs)"]
    finally:
        close(fig)


def test_the_headline_sorts_rows_with_their_intervals_and_marks_the_disturbed():
    from llmadapt.analysis.comparison import Row
    from llmadapt.analysis.figures import close
    from llmadapt.analysis.figures_train import headline
    from llmadapt.analysis.uncertainty import bootstrap_median

    def row(label, step, disturbed=()):
        estimates = {"step_p50_s": bootstrap_median([step, step * 1.1, step * 0.95], "runs"),
                     "tokens_per_s": bootstrap_median([1 / step, 1.1 / step, 0.9 / step], "runs")}
        return Row(label=label, adapter="torch", variant="", run_dir=None, status="ok", metrics={},
                   problem_hash="h", estimates=estimates, disturbed=list(disturbed))

    fig = headline([row("slow", 0.05), row("fast", 0.01), row("noisy", 0.03, ["other processes"])], {"h": "P1"})
    try:
        step, tokens = visible(fig)
        assert [t.get_text() for t in step.get_yticklabels()] == ["fast", "noisy (disturbed)", "slow"]
        assert len(step.patches) == 3 and step.patches[1].get_hatch() == "///"
        assert step.collections and tokens.collections  # the 95% intervals, as error bars
    finally:
        close(fig)


def test_the_report_holds_the_verdict_scaling_and_topology_as_data_and_draws_the_efficiency():
    """The page carries the comparison's answers as data (its verdicts, scaling points and each row's topology, as
    compare --json has them), and a figure of scaling efficiency against the devices, a line per stack."""
    import html
    import json

    from llmadapt.analysis.comparison import Comparison, Row
    from llmadapt.analysis.figures import close
    from llmadapt.analysis.figures_train import scaling_efficiency
    from llmadapt.analysis.htmlreport import _answers
    from llmadapt.analysis.uncertainty import Estimate
    from llmadapt.contract.records import Topology

    w = train("tiny-llama")

    def row(label, devices, median, disturbed=()):
        return Row(label=label, adapter=label.split()[0], variant="", run_dir=None, status="ok",
                   problem_hash=w.problem_hash, metrics={"devices": devices, "step_p50_s": median,
                                                         "tokens_per_s": 100 / median},
                   estimates={"step_p50_s": Estimate(median, median * 0.9, median * 1.1, 5, "steps")},
                   disturbed=list(disturbed), topology=Topology(interconnect="cpu", numa_nodes=1))

    c = Comparison(rows=[row("torch dp1", 1, 1.0), row("torch dp2", 2, 0.6, ["load"]), row("deepspeed dp1", 1, 1.2),
                         row("deepspeed dp2", 2, 0.7)], workloads={w.problem_hash: w})
    data = json.loads(html.unescape(_answers(c)))
    assert data["verdicts"][0]["withheld"].startswith("the machine was disturbed during torch dp2")
    assert {(p["stack"], p["devices"], p["disturbed"]) for p in data["scaling"]} == {
        ("torch", 1, False), ("torch", 2, True), ("deepspeed", 1, False), ("deepspeed", 2, False)}
    assert data["topology"]["torch dp1"]["interconnect"] == "cpu"
    fig = scaling_efficiency(c.scaling())
    try:
        (ax,) = visible(fig)
        labels = ax.get_legend_handles_labels()[1]
        assert "torch, strong" in labels and "deepspeed, strong" in labels
        assert "hollow: measured on a disturbed machine" in labels
    finally:
        close(fig)
    assert scaling_efficiency([]) is None
