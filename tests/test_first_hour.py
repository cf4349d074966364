"""The first hour, continued (tests/test_cli.py has the flags): what `pip install` leaves behind.

What it is:
  - the `ladder` console script is on the PATH and each subcommand's `--help` names itself
    as typed (`ladder serve`, not `python -m level6_serving`), run as real subprocesses;
  - the LICENSE file exists and is the license pyproject.toml declares.

What it is not: a test of the tools themselves (their own test files run them); level 5's
`if __name__ == "__main__":` check is in tests/test_level5.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from ladder.models import REPO

pytestmark = pytest.mark.docs


@pytest.mark.parametrize(
    "args,usage",
    [
        ([], "usage: ladder {serve,bench,labs,watch,trace,disagg,demo N}"),
        (["trace"], "usage: ladder trace "),
        (["watch"], "usage: ladder watch "),
        (["serve"], "usage: ladder serve "),
        (["bench"], "usage: ladder bench "),
        (["labs"], "usage: ladder labs "),
        (["labs", "check"], "usage: ladder labs check "),
        (["demo", "3"], "usage: ladder demo 3 "),
    ],
)
def test_the_ladder_command_names_itself_in_help(args, usage, tmp_path):
    ladder = shutil.which("ladder")
    if ladder is None:
        pytest.skip("the `ladder` console script is not installed (pip install -e . puts it on the PATH)")
    run = subprocess.run([ladder, *args, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith(usage), run.stdout[:300]
    assert "python -m" not in run.stdout.split("\n\n")[0], "the usage line still names the python -m form"


def test_the_license_is_the_one_pyproject_declares():
    declared = re.search(r'^license = \{ text = "(.+?)" \}', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    text = (REPO / "LICENSE").read_text()
    assert declared == "MIT" and text.startswith("MIT License") and "the inference-ladder authors" in text
