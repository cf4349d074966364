"""`python -m benchmarks.simulate` shows its progress: a line on stderr as each part finishes, long before its
tables (at the defaults it ran six minutes with nothing on screen).

What it is not: a test of the simulator's numbers (tests/test_simulator.py).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.bench


def test_the_simulator_says_what_it_finished_as_it_goes(tmp_path, capsys):
    import benchmarks.simulate as cli

    argv = ["--trace", "alpaca", "--requests", "20", "--points", "2", "--tp", "1", "2", "--no-plot",
            "--out", str(tmp_path / "a.json")]  # fmt: skip
    cli.main(argv)
    err = capsys.readouterr().err.splitlines()
    lines = [line for line in err if "] " in line and "/" in line]
    assert any("sustainable rate of vllm" in line for line in lines), err
    assert lines[-1].split("] ", 1)[1].startswith(f"{len(lines)}/{len(lines)} "), lines  # every part, counted
    cli.main([*argv, "--no-progress"])
    assert not capsys.readouterr().err.strip()
