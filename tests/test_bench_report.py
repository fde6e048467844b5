"""The benchmark table: its ratio column cannot be read as the row's own speed-up."""

from sb3_speedups.bench.report import format_table


def test_ratio_column_names_the_reference_and_leaves_its_row_empty():
    stats = {"class": "x.PPO", "num_threads": 1, "median_learn_seconds": 1.0, "median_steps_per_second": 100.0,
             "final_returns": [500.0], "median_peak_memory_mb": 300.0}  # fmt: skip
    summary = {"variants": {"ours": stats, "stock": {**stats, "median_learn_seconds": 5.44}}, "speedup": {"stock": 5.44},
               "reference": "ours"}  # fmt: skip
    header, _, ours, stock = format_table(summary).splitlines()
    assert "| ours is faster by |" in header and "speed-up" not in header
    assert "| 1.00 | - |" in ours and "| 5.44 | 5.44x |" in stock
