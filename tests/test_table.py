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
