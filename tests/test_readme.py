"""The README runs as written: its Python blocks (docs are executable, with the built-in model), and
its quick start, two commands, each of which installs what it then runs.

What it is not: an install on a fresh machine (`.ci/run` does that); the quick start's packages are
checked against pyproject.toml and the imports of the demos' files.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.docs


def python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(python_blocks(REPO / "README.md"))))
def test_readme_block_runs(index, monkeypatch, capsys, collect_before_each_engine):
    monkeypatch.chdir(REPO)
    exec(compile(python_blocks(REPO / "README.md")[index], f"README.md block {index}", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.strip(), "every README block shows its reader something"
    if index == 0:  # every level prints the same text
        texts = [line.split(" ", 1)[1] for line in printed.strip().splitlines()]
        assert len(texts) == 5 and len(set(texts)) == 1


# The quick start: two commands, the first for the demos, the second for the tests.
HEAVY = {"ray", "playwright", "guidellm", "schemathesis"}  # the test clients the first command leaves out
TESTS_NEED = {"pytest", "pytest-xdist", "hypothesis", "scipy", "jsonschema", "openai", "httpx", *HEAVY}
PROJECT = ("level", "ladder", "features", "benchmarks", "labs", "models")


def quick_start() -> tuple[list[str], str]:
    """The quick start's commands, and the paragraph that follows them."""
    section = (REPO / "README.md").read_text().split("## Quick start", 1)[1]
    block, after = re.search(r"```bash\n(.*?)```\n\n(.*?)\n\n", section, re.S).groups()
    return block.strip().splitlines(), after


def requirements(command: str) -> set[str]:
    """The distributions `pip install ... -e ".[extras]"` asks for: the project's and its extras'."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (named,) = re.findall(r'-e "\.(?:\[(.*?)\])?"', command)
    reqs = list(project["dependencies"])
    for extra in filter(None, named.split(",")):
        reqs += project["optional-dependencies"][extra.strip()]
    return {re.match(r"[A-Za-z0-9_.-]+", r).group().lower() for r in reqs}


def closure(names: set[str]) -> set[str]:
    """`names` and every distribution they require, as installed here (markers and extras aside)."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [re.match(r"[A-Za-z0-9_.-]+", r).group().lower() for r in reqs if "extra ==" not in r]
    return {n.replace("_", "-") for n in seen}


def demo_imports() -> set[str]:
    """The distributions whose modules the demos' files import (the server's too: level 6's demo starts it)."""
    files = [*REPO.glob("level*/demo.py"), REPO / "level3_prefix/beam_demo.py", *REPO.glob("features/*/demo.py"),
             *REPO.glob("level6_serving/*.py")]  # fmt: skip
    dists = importlib.metadata.packages_distributions()
    found = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else []  # fmt: skip
            for top in {n.split(".")[0] for n in names}:
                if top not in sys.stdlib_module_names and not top.startswith(PROJECT):
                    found.update(d.lower().replace("_", "-") for d in dists.get(top, [top]))
    return found


def test_the_quick_start_is_two_commands_each_installing_what_it_runs():
    (demos, tests), _ = quick_start()
    assert "torch==2.13.0" in demos and demos.endswith("&& python -m level3_prefix.demo")  # a bare torch is CUDA's
    assert tests.startswith('pip install -e ".[dev]"') and tests.endswith("&& python -m pytest")
    first = requirements(demos)
    assert not first & HEAVY, f"the demos' command installs the tests' heavy clients: {first & HEAVY}"
    missing = demo_imports() - closure(first | {"torch"})
    assert not missing, f"the demos import {missing}, which the first command does not install"
    second = requirements(tests)
    assert first <= second and TESTS_NEED <= second, TESTS_NEED - second


def test_the_quick_start_says_in_two_sentences_what_each_command_does():
    _, after = quick_start()
    sentences = [s for s in re.split(r"(?<=\.)\s+(?=[A-Z])", after) if s]
    assert len(sentences) == 2, sentences
    assert "demo" in sentences[0] and "minutes" in sentences[1] and "test" in sentences[1]


def test_the_batch_invariance_cost_agrees_with_its_demo():
    """The README's float32 range holds the demo's own measurements it quotes (the demo once said 0.40x: the
    default mode paid both modes' warm-up)."""
    text = " ".join((REPO / "README.md").read_text().split("## Batch invariance", 1)[1].split("##", 1)[0].split())
    low, high = map(float, re.search(r"about (\d\.\d+)-(\d\.\d+)x the time in float32", text).groups())
    quoted = re.search(r"warmed up first \(([\d.]+)x and ([\d.]+)x in two runs", text)
    assert quoted and all(low <= float(x) <= high for x in quoted.groups()), (low, high, quoted)
