"""The one table renderer: text stays text, numbers line up on the right, missing values are '-'."""

from llmadapt.analysis.table import text_table


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
    from llmadapt.analysis.compare import Comparison, Row

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
