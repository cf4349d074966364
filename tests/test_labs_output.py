"""`python -m labs experiment` and `run` write a run's pictures and JSON into the student's folder.

What it is: the environment `labs/cli.py` gives the experiment's process (`INFERENCE_LADDER_OUT`,
which `ladder.cli.output_dir` reads), for a folder and for a file; and a benchmark's 400 MB
checkpoint is built in `ladder.cli.cache_dir`, never there. No engine runs.
What it is not: the experiments themselves (tests/test_labs.py runs them small).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from labs import cli
from labs.spec import get
from ladder.cli import cache_dir, output_dir

pytestmark = pytest.mark.labs


@pytest.mark.parametrize("as_file", [False, True])
def test_an_experiment_writes_into_the_student_s_folder(tmp_path, monkeypatch, as_file):
    lab = get("4")  # one file: a path to it is a whole hand-in
    for m in lab.modules:
        shutil.copy(m.reference_path, tmp_path / m.filename)
    seen = {}

    def run(cmd, env, **kw):
        seen.update(env)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(cli.subprocess, "run", run)
    path = tmp_path / lab.modules[0].filename if as_file else tmp_path
    assert cli.main(["experiment", "4", str(path)]) == 0
    assert seen["INFERENCE_LADDER_OUT"] == str(tmp_path.resolve())


def test_a_built_checkpoint_is_cached_outside_the_output_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERENCE_LADDER_OUT", str(tmp_path))
    assert output_dir() == tmp_path and tmp_path not in cache_dir().parents and cache_dir() != tmp_path
