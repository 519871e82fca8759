"""The one table renderer: text stays text, numbers line up on the right, missing values are '-'."""

from llmadapt.texttable import text_table


def test_a_table_keeps_labels_as_written_and_right_aligns_numbers():
    lines = text_table(["run", "status", "step p50 s", "parity delta"],
                       [["torch [recompute=none,dp=1]", "ok", "0.2414", "0.00e+00"],
                        ["torch [dp=2]", "failed", None, "-"]])
    assert lines == [
        "run                           status   step p50 s   parity delta",
        "-" * 64,
        "torch [recompute=none,dp=1]   ok           0.2414       0.00e+00",
        "torch [dp=2]                  failed            -              -",
    ]


def test_a_column_of_text_stays_left_aligned():
    assert text_table(["name", "n"], [["a", "1"], ["bbb", "x"]]) == ["name   n", "-" * 8, "a      1", "bbb    x"]


def test_compare_prints_strong_and_weak_scaling_where_the_rows_allow():
    """A dp 1/2 grid of one problem is strong scaling (speedup of the step, efficiency over the device ratio); a
    problem whose global batch grew with the devices is weak scaling (tokens/s per device); a superlinear figure
    is marked as the artefact it is; rows of one device count say nothing about scaling."""
    from pathlib import Path

    from llmadapt import Workload
    from llmadapt.analysis.comparison import Comparison, Row

    w = Workload.from_file(Path(__file__).resolve().parents[1] / "examples" / "tiny-llama.toml")
    big = w.with_overrides(["train.global_batch=16"])

    def row(label, workload, devices, step, tokens):
        return Row(label=label, adapter="torch", variant="", run_dir=None, status="ok", problem_hash=workload.problem_hash,
                   metrics={"devices": devices, "step_p50_s": step, "tokens_per_s": tokens})

    rows = [row("torch dp1", w, 1, 1.0, 100.0), row("torch dp2", w, 2, 0.625, 160.0),
            row("torch dp4", w, 4, 0.2, 500.0), row("torch dp2", big, 2, 1.25, 150.0),
            row("torch dp2 recompute=full", w, 2, 0.7, 140.0)]  # another technique: no dp1 to scale against
    text = Comparison(rows, workloads={w.problem_hash: w, big.problem_hash: big}).table()
    lines = [line.split() for line in text.splitlines()]
    assert ["P1", "torch", "dp2", "2", "strong", "1.60x", "80%", "torch", "dp1"] in lines  # 1.0 / 0.625 on 2
    assert ["P1", "torch", "dp4", "4", "strong", "5.00x", "125%!", "torch", "dp1"] in lines  # superlinear: marked
    assert ["P2", "torch", "dp2", "2", "weak", "1.50x", "75%", "torch", "dp1"] in lines  # 150/2 per device vs 100
    assert not any("recompute=full" in line and "strong" in line for line in lines)
    assert any(line.startswith("!: above 110%") for line in text.splitlines())
    one = Comparison([row("torch dp1", w, 1, 1.0, 100.0), row("torch dp1", w, 1, 1.1, 90.0)],
                     workloads={w.problem_hash: w}).table()
    assert "scaling" not in one


def test_the_verdict_names_the_fastest_the_indistinguishable_and_withholds_what_it_cannot_back():
    """Under the table: the fastest row by its headline median, the rows whose 95% intervals overlap it (cannot
    be told apart), the slower ones by how much; --baseline sets the reference of the vs column; a disturbed
    machine or a single sample withholds the verdict, saying why, and a disturbed side gets no percentage."""
    import attrs

    from llmadapt.analysis.comparison import Comparison, Row
    from llmadapt.analysis.uncertainty import Estimate

    def row(label, median, low, high, n=5, disturbed=()):
        e = Estimate(median, low, high, n, "runs")
        return Row(label=label, adapter=label.split()[0], variant="", run_dir=None, status="ok", problem_hash="p",
                   metrics={"step_p50_s": median}, cell=label.split()[0], estimates={"step_p50_s": e},
                   disturbed=list(disturbed))

    rows = [row("megatron tp2", 1.5, 1.4, 1.6), row("torch dp1", 1.0, 0.95, 1.05), row("deepspeed dp2", 1.02, 0.97, 1.08)]
    table = Comparison(rows=rows).table()
    assert ("P1 verdict: fastest torch dp1; cannot be told apart from it: deepspeed dp2; slower: megatron tp2 +50% "
            "(medians and 95% intervals over runs)") in table
    body = table.splitlines()[2:5]
    assert [line.split()[6] for line in body] == ["-", "-33%", "-32%"]  # against the first row: megatron
    based = Comparison(rows=rows, baseline="torch").table()
    assert "vs baseline" in based and [line.split()[6] for line in based.splitlines()[2:5]] == ["+50%", "-", "≈"]
    noisy = [rows[0], attrs.evolve(rows[1], disturbed=["other processes kept 0.93 of 2 cores busy"]), rows[2]]
    text = Comparison(rows=noisy).table()
    assert ("P1 verdict withheld: the machine was disturbed during torch dp1 (1 run(s); other processes kept 0.93 "
            "of 2 cores busy); rerun on a quiet machine") in text and "fastest" not in text
    assert text.splitlines()[3].split()[6] == "disturbed"
    short = Comparison(rows=[rows[0], attrs.evolve(rows[1], judged=False)]).table()
    assert "P1 verdict: fastest torch dp1; slower: megatron tp2 +50%" in short and \
        "quiet not judged for torch dp1: measured steps under half a second" in short
    # three runs a row: wholly apart one time in ten for identical configurations, so never named slower
    three = Comparison(rows=[row("megatron tp2", 1.5, 1.4, 1.6, n=3), row("torch dp1", 1.0, 0.95, 1.05, n=3)]).table()
    assert "P1 verdict: fastest torch dp1; cannot be told apart from it: megatron tp2" in three
    assert "4 runs a row are needed to tell rows apart over runs, fewer for megatron tp2, torch dp1" in three
    lone = [rows[0], row("torch dp1", 1.0, 1.0, 1.0, n=1)]
    assert "P1 verdict withheld: a single sample, no interval to judge by: torch dp1" in Comparison(rows=lone).table()


def test_rows_over_runs_are_told_apart_by_a_rank_test_on_the_runs():
    """Repeated rows: a two-sided Mann-Whitney test on the runs' values (p < 0.05) tells rows apart, which finds a
    difference that overlapping bootstrap intervals would hide (five runs a row, one pair crossing), and keeps
    interleaved runs together; never with fewer than four runs a row."""
    from llmadapt.analysis.comparison import Comparison, Row
    from llmadapt.analysis.uncertainty import bootstrap_median

    def row(label, runs):
        e = bootstrap_median(runs, "runs")
        return Row(label=label, adapter=label.split()[0], variant="", run_dir=None, status="ok", problem_hash="p",
                   metrics={"step_p50_s": e.median}, cell=label.split()[0], estimates={"step_p50_s": e})

    fast, slow = row("torch dp1", [1.0, 1.01, 1.02, 1.03, 1.06]), row("deepspeed dp2", [1.05, 1.07, 1.08, 1.09, 1.10])
    assert fast.estimates["step_p50_s"].overlaps(slow.estimates["step_p50_s"])  # intervals alone: a tie
    text = Comparison(rows=[fast, slow]).table()
    assert ("P1 verdict: fastest torch dp1; slower: deepspeed dp2 +6% (medians and 95% intervals over runs; told "
            "apart by a two-sided Mann-Whitney test over the runs, p < 0.05)") in text
    mixed = row("deepspeed dp2", [1.005, 1.015, 1.025, 1.035, 1.05])  # interleaved with torch's runs
    assert "cannot be told apart from it: deepspeed dp2" in Comparison(rows=[fast, mixed]).table()
    few = [row("torch dp1", [1.0, 1.01, 1.02]), row("deepspeed dp2", [2.0, 2.01, 2.02])]  # apart, but three a row
    assert "cannot be told apart from it: deepspeed dp2" in Comparison(rows=few).table()


def test_the_ascii_layout_is_richs():
    """Plain ASCII tables are laid out without rich (its import is most of `llmadapt adapters`' time): the lines are
    the ones rich prints, on tables of every shape the commands make (numbers, '-', empty cells, one column, no rows);
    other cells (a tab, a space at an end, non-ASCII) still go through rich."""
    import random
    import string

    from llmadapt import texttable

    rng = random.Random(0)
    letters = string.ascii_letters + string.digits + " -.,%+[]=:/_()'*#"

    def cell():
        return rng.choice([None, "-", "", f"{rng.uniform(-1e4, 1e4):.{rng.randint(0, 4)}f}", f"{rng.random():.2e}",
                           str(rng.randint(0, 10**6)), " padded ", "a\tb", "≈",
                           "".join(rng.choice(letters) for _ in range(rng.randint(1, 20)))])

    plain = 0
    for _ in range(400):
        width = rng.randint(1, 6)
        head = ["".join(rng.choice(letters) for _ in range(rng.randint(0, 10))) for _ in range(width)]
        rows = [[cell() for _ in range(width)] for _ in range(rng.randint(0, 6))]
        body = [["-" if c is None else str(c) for c in row] for row in rows]
        right = [bool(body) and all(texttable._NUMBER.match(r[i]) for r in body) and any(r[i] != "-" for r in body)
                 for i in range(width)]
        assert texttable.text_table(head, rows) == texttable._rich_lines(head, body, right), (head, rows)
        plain += all(texttable._PRINTABLE_ASCII.fullmatch(c) for c in head + sum(body, [])) and all(
            any(column) for column in zip(head, *body))
    assert 50 < plain < 400  # both ways were taken


def test_a_narrow_terminal_gets_the_columns_read_most_and_is_told_what_was_left_out():
    """Width given (a terminal): columns leave in NARROW_DROP's order until the table fits, and a line under it
    names them; --columns chooses instead (by key or title, any case; an unknown one is one line listing the
    known); no width (a file, a pipe, the docs' transcripts): every column."""
    import pytest

    from llmadapt.analysis.comparison import Comparison, Row, column_keys
    from llmadapt.errors import LlmadaptError

    metrics = {"devices": 1, "step_p50_s": 0.0123, "step_p90_s": 0.0151, "tokens_per_s": 41234.0,
               "samples_per_s": 80.5, "peak_memory_mib": 512.0, "first_loss": 6.2409, "last_loss": 5.9876,
               "parity_delta": 1.2e-7}
    rows = [Row(label=f"deepspeed dp2 zero{z} offload=optimizer", adapter="deepspeed", variant="", run_dir=None,
                status="ok", problem_hash="p" * 64, metrics=metrics) for z in (1, 2, 3)]
    c = Comparison(rows)
    full = c.table().splitlines()
    assert "step p90 s" in full[0] and "left out" not in "\n".join(full)
    wide = max(map(len, full[:5]))
    narrow = c.table(width=wide - 1).splitlines()
    assert max(map(len, narrow[:5])) <= wide - 1
    assert "step p90 s" not in narrow[0] and "tokens/s" in narrow[0] and "last loss" in narrow[0]
    assert narrow[5] == ("left out to fit %d columns: step p90 s (--columns to choose, --json for all)" % (wide - 1))
    tight = c.table(width=110).splitlines()
    assert max(map(len, tight[:5])) <= 110, tight
    assert tight[5].startswith("left out to fit 110 columns: step p90 s, samples/s, first loss, peak mem MiB (")
    # what is read most stays, wider than the terminal or not (the terminal wraps it)
    assert c.table(width=60).splitlines()[0].split() == tight[0].split() == [
        "problem", "run", "status", "step", "p50", "s", "tokens/s", "last", "loss", "parity", "delta"]
    assert c.table(width=wide).splitlines() == full  # fits: nothing left out
    chosen = c.table(columns=["Tokens/s", "step_p50_s"], width=40).splitlines()
    assert chosen[0].split() == ["problem", "run", "status", "tokens/s", "step", "p50", "s"]
    with pytest.raises(LlmadaptError, match=r"^unknown column 'tok/s': choose from step_p50_s, step_p90_s"):
        column_keys(["tok/s"])


def test_the_runs_listing_labels_each_run_by_what_sets_it_apart():
    """`runs` lists two runs of one layout on two sparsities: each layout names its experts per token."""
    from pathlib import Path

    from llmadapt import Workload
    from llmadapt.analysis.store import StoredRun
    from llmadapt.cli.results import _runs_table

    w = Workload.from_file(Path(__file__).resolve().parents[1] / "examples" / "tiny-mixtral.toml")

    def stored(run_id, workload):
        return StoredRun(run_id=run_id, folder=Path(run_id), status="ok", adapter="torch", layout="torch dp1",
                         workload_hash=workload.content_hash, problem_hash=workload.problem_hash, machine="m",
                         created="2026-01-01T00:00", workload=workload.to_dict(), summary={}, metrics={}, row={})

    text = _runs_table([stored(f"r{k}", w.with_overrides([f"model.experts_per_token={k}"])) for k in (2, 4)])
    assert "torch dp1 experts_per_token=2" in text and "torch dp1 experts_per_token=4" in text


def test_the_verdict_and_the_scaling_are_data_that_the_lines_render(tmp_path):
    """The verdict (fastest, within noise, slower by how much with an interval, or withheld and why) and the scaling
    (per stack and technique, disturbed rows marked) are typed results: in Comparison.verdicts() and .scaling(), in
    to_dict (compare --json) and in the saved compare file; the printed lines are rendered from them."""
    import json
    from pathlib import Path

    import attrs

    from llmadapt import Workload
    from llmadapt.analysis.comparison import Comparison, Row
    from llmadapt.analysis.uncertainty import Estimate
    from llmadapt.analysis.verdict import ScalingPoint, Slower, Verdict
    from llmadapt.experiments.compare import ComparisonFile

    w = Workload.from_file(Path(__file__).resolve().parents[1] / "examples" / "tiny-llama.toml")

    def row(label, devices, median, low, high, disturbed=()):
        e = Estimate(median, low, high, 5, "steps")
        return Row(label=label, adapter="torch", variant="", run_dir=None, status="ok", problem_hash=w.problem_hash,
                   metrics={"devices": devices, "step_p50_s": median, "tokens_per_s": 100 / median},
                   estimates={"step_p50_s": e}, disturbed=list(disturbed), layout=label.split(" (")[0])

    rows = [row("torch dp1", 1, 1.0, 0.9, 1.1), row("torch dp2", 2, 0.6, 0.55, 0.65),
            row("torch dp4", 4, 0.58, 0.5, 0.7)]
    c = Comparison(rows=rows, workloads={w.problem_hash: w})
    (v,) = c.verdicts()
    # the change's interval: the far ends of the two 95% intervals (0.9/0.65 - 1 and 1.1/0.55 - 1)
    assert v == Verdict(problem="P1", problem_hash=w.problem_hash, metric="step_p50_s", fastest="torch dp4",
                        ties=["torch dp2"], slower=[Slower("torch dp1", 1.0 / 0.58 - 1, 0.9 / 0.7 - 1, 1.1 / 0.5 - 1)],
                        over="steps", rows=3)
    assert c.verdict_lines({w.problem_hash: "P1"}, "step_p50_s") == [v.text()] and v.text() in c.table()
    assert [(p.label, p.devices, p.scaling, round(p.efficiency, 6)) for p in c.scaling()] == [
        ("torch dp1", 1, "strong", 1.0), ("torch dp2", 2, "strong", round(1 / 0.6 / 2, 6)),
        ("torch dp4", 4, "strong", round(1 / 0.58 / 4, 6))]
    assert all(isinstance(p, ScalingPoint) and p.stack == "torch" and not p.disturbed for p in c.scaling())
    data = json.loads(json.dumps(c.to_dict(), default=str))
    assert data["verdicts"][0]["fastest"] == "torch dp4" and data["verdicts"][0]["slower"][0]["label"] == "torch dp1"
    assert [p["efficiency"] for p in data["scaling"]] == [p.efficiency for p in c.scaling()]
    saved = json.loads(Path(ComparisonFile(tmp_path, w, print).write(c).saved).read_text())
    assert saved["verdicts"] == data["verdicts"] and saved["scaling"] == data["scaling"]
    # a disturbed row: the verdict withheld, with its reason as data; the scaling row marked as in the headline
    noisy = Comparison(rows=[rows[0], attrs.evolve(rows[1], disturbed=["other processes kept 1.2 of 2 cores busy"])],
                       workloads={w.problem_hash: w})
    (held,) = noisy.verdicts()
    assert held.fastest is None and held.withheld.startswith("the machine was disturbed during torch dp2")
    assert [p.disturbed for p in noisy.scaling()] == [False, True]
    assert "torch dp2 (disturbed)" in noisy.table() and "ran on a disturbed machine" in noisy.table()
