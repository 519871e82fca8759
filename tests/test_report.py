"""The self-contained HTML report, opened in a real headless browser (Debian's chromium, driven by Selenium through
Debian's chromedriver): no console error, no network request, every chart and table row it should have, and a
sortable table. Made from real runs: dense and MoE training (one profiled), a second batch size, two load points of
a streaming server."""

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
    generator against a streaming test server at two request rates."""
    out = tmp_path_factory.mktemp("runs")
    assert run(train("tiny-llama", "train.global_batch=4", "profile.steps=[2]", "profile.level=operator"), "torch",
               out=out).ok
    for batch in (8, 16):
        assert run(train("tiny-llama", f"train.global_batch={batch}"), "torch", out=out).ok
    assert run(train("tiny-mixtral", "train.global_batch=4", "eval.examples=4"), "torch", out=out).ok
    if not environments_unready("plain"):
        assert run(train("tiny-llama", "train.global_batch=4"), "plain", out=out).ok
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


EXPECTED_CHARTS = {"loss", "step_time", "memory", "breakdown_modules", "breakdown_operators",
                   "breakdown_module_operators", "expert_load",
                   "evaluation", "eval_expert_load", "latency_cdf", "latency_vs_load", "throughput_vs_batch"}


def test_the_report_holds_the_table_and_every_figure_its_runs_have(runs, tmp_path):
    folders = collect([runs])
    text, figures, comparison = build(folders)
    assert set(figures) == EXPECTED_CHARTS  # no estimate: this CPU is not in the device catalog
    assert text.count('<figure class="chart"') == len(EXPECTED_CHARTS)
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


@pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                    reason="needs Debian's chromium and chromium-driver (.ci/run installs them)")
def test_the_report_opens_in_headless_chromium_without_errors_or_network(runs, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    path = report([runs], tmp_path / "report.html")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
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
