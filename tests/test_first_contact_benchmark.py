"""benchmarks/first_contact.py: its command line and its table (the runs themselves are the benchmark's)."""

from __future__ import annotations

import pytest

from benchmarks import first_contact


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as e:
        first_contact.main(["--help"])
    assert e.value.code == 0 and "--background" in capsys.readouterr().out


@pytest.mark.parametrize("args", [["--nproc", "0"], ["--nproc", "x"], ["--background", "loud"]])
def test_bad_arguments_are_one_line_and_exit_2(args, capsys):
    assert first_contact.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("first_contact.py: error:") and "\n" not in err


def test_the_table_shows_each_run_against_its_target():
    runs = [{"background": "busy", "nproc": 1, "run": "first", "predicted_step_ms": 8.65,
             "measured_step_ms": 8.48, "prediction_error": 0.020},
            {"background": "busy", "nproc": 1, "run": "second", "predicted_step_ms": 8.48,
             "measured_step_ms": 8.06, "prediction_error": 0.052},
            {"background": "off", "nproc": 2, "run": "first", "predicted_step_ms": 13.8,
             "measured_step_ms": 14.28, "prediction_error": -0.033}]
    lines = first_contact.table(runs).splitlines()
    assert len(lines) == 4
    assert lines[1].split()[-3:] == ["+2.0%", "30", "%"] and lines[2].split()[-3:] == ["+5.2%", "15", "%"]
    assert lines[3].split()[-2:] == ["-3.3%", "-"]
