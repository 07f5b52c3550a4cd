"""The identifiability study end to end through the CLI, at a size that runs in seconds."""

import pandas as pd
import pytest

from moplex_core.cli import main


def test_study_writes_results_plot_and_table(tmp_path, capsys):
    out = tmp_path / "study"
    code = main(
        ["experiment", "identifiability", "--out", str(out), "--n", "300", "--seeds", "2",
         "--k", "2", "--m", "2", "8", "--max-iter", "20", "--restarts", "1", "--n-test", "2000", "--quiet"]
    )
    assert code == 0
    results = pd.read_parquet(out / "results.parquet")
    # k=2: m in {2, 8} plus m=2 augmented in three modes, two seeds, EM and oracle rows
    assert len(results) == 5 * 2 * 2
    assert set(results.augment) == {"none", "below", "random", "top_m"}
    assert set(results[results.augment != "none"].m_prime) == {4}
    assert (out / "accuracy_vs_m.png").read_bytes()[:4] == b"\x89PNG"
    table = (out / "table.md").read_text()
    assert "| 2 | em |" in table and "| 2 | oracle |" in table
    m8 = results[(results.m == 8) & (results.augment == "none")].pivot_table(index="seed", columns="method", values="accuracy")
    assert (m8.em > 0.9).all() and ((m8.oracle - m8.em).abs() < 0.05).all()
    printed = capsys.readouterr().out
    assert str(out / "results.parquet") in printed


def test_the_table_shows_a_spread_only_over_several_seeds():
    from moplex_core.experiments.identifiability import summary_table

    rows = [{"k": 2, "method": "em", "m": 4, "m_prime": 4, "augment": "none", "seed": s, "accuracy": a}
            for s, a in ((0, 0.8), (1, 0.9))]
    assert "| 0.850 ± 0.071 |" in summary_table(pd.DataFrame(rows))  # the sample std, as the plot's bars
    assert "| 0.800 |" in summary_table(pd.DataFrame(rows[:1]))
    oracle = [{**row, "method": "oracle", "accuracy": a} for row, a in zip(rows, (0.85, 0.91))]
    lines = summary_table(pd.DataFrame(rows + oracle)).splitlines()
    # paired by seed: -0.05 and -0.01, mean -0.03, standard error 0.02
    assert lines[-1] == "| 2 | em − oracle (± s.e.) | -0.030 ± 0.020 |"
    stopped = [{**row, "iterations": n} for row, n in zip(rows, (12, 100))]  # seed 1's best fit ran out of iterations
    marked = summary_table(pd.DataFrame(stopped + oracle), max_iter=100).splitlines()
    assert "| 2 | em | 0.850 ± 0.071* |" in marked and marked[-1].startswith("`*`: in at least one seed EM's best fit")
    assert "*" not in summary_table(pd.DataFrame(stopped + oracle), max_iter=101)


def test_impossible_settings_are_refused_in_one_line_before_any_work(capsys):
    for command, argv, message in [
        ("identifiability", ["--seeds", "0"], "argument --seeds: expected an integer of at least 1, got '0'"),
        ("identifiability", ["--m", "3", "1"], "argument --m: expected an integer of at least 2, got '1'"),
        ("identifiability", ["--noise", "-1"], "argument --noise: expected a finite number above 0"),
        ("identifiability", ["--noise", "0"], "argument --noise: expected a finite number above 0, got '0'"),
        ("identifiability", ["--k", "2", "1"], "argument --k: expected an integer of at least 2, got '1'"),
        ("identifiability", ["--seed", "-1"], "argument --seed: expected an integer of at least 0"),
        ("approximation", ["--cache", "x", "--examples", "0"], "argument --examples: expected an integer of at least 1"),
    ]:
        with pytest.raises(SystemExit) as stopped:
            main(["experiment", command, *argv])
        assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_a_study_whose_smallest_training_set_cannot_fit_its_largest_k_is_refused_before_the_first_cell(tmp_path, capsys):
    code = main(["experiment", "identifiability", "--out", str(tmp_path), "--n", "3", "--k", "2", "4", "--m", "3",
                 "--seeds", "1", "--quiet"])
    assert code == 1
    assert "n_train = 3 training rankings cannot fit k = 4 clusters" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_the_study_plot_leaves_the_callers_matplotlib_backend_and_pyplot_alone(tmp_path):
    """A notebook calling plot_study keeps its backend (it set Agg for the whole process before)."""
    import subprocess
    import sys

    script = f"""
import matplotlib, sys
import pandas as pd
matplotlib.use("svg")
from moplex_core.experiments.identifiability import plot_study
rows = [dict(k=k, method=method, m=m, m_prime=m, augment=augment, seed=s, accuracy=0.5 + 0.1 * s)
        for k in (2, 3) for method in ("em", "oracle") for m in (2, 4) for augment in ("none", "below")
        for s in (0, 1)]
plot_study(pd.DataFrame(rows), {str(tmp_path / "plot.png")!r})
print(matplotlib.get_backend(), "matplotlib.pyplot" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["svg", "False"]
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


def test_a_study_without_m_2_labels_its_augmented_bars_and_repeats_are_refused(tmp_path, capsys):
    import warnings

    from moplex_core.experiments.identifiability import plot_study

    rows = [dict(k=2, method=method, m=m, m_prime=m_prime, augment=augment, seed=0, accuracy=0.7)
            for method in ("em", "oracle")
            for m, m_prime, augment in ((3, 3, "none"), (2, 4, "below"), (2, 4, "random"), (2, 4, "top_m"))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels found to put in legend"
        plot_study(pd.DataFrame(rows), tmp_path / "plot.png")
    code = main(["experiment", "identifiability", "--out", str(tmp_path / "study"), "--k", "2", "2", "--m", "3", "3",
                 "--seeds", "1", "--quiet"])
    assert code == 1 and not (tmp_path / "study").exists()
    assert "ks = [2, 2], ms = [3, 3] repeat a value" in capsys.readouterr().err
