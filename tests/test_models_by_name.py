"""Models by name: a hub id is downloaded on first use, then loaded from the cache (ladder/models.py).

What it is: a fake Hugging Face Hub on loopback, serving a `save_pretrained` checkpoint as the
real hub does to huggingface_hub's `snapshot_download` (repository info, the file tree, each
file's HEAD and GET with the headers `hf_hub_download` checks), and the checks of issue 50's
first deliverable against it: download then the same tokens as the local directory; the cache
alone with HF_HUB_OFFLINE=1; one-line errors for an unknown repository, a gated one without a
token, and no network; `revision` and `download_dir` from `LLM(...)`, the demos' flags and
`ladder serve MODEL` (a positional model, as `vllm serve`); a help string on every flag.

What it is not: a test of huggingface_hub. Nothing leaves the machine: huggingface_hub reads
HF_ENDPOINT when imported, so its constants are patched here (the URL template too).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import shutil
import socket
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from ladder.models import resolve_path

REPO_ID, GATED_ID = "ladder-org/tiny-llama", "ladder-org/gated"


def commit_of(repo: str, revision: str) -> str:
    return hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()


class FakeHub(http.server.ThreadingHTTPServer):
    """repos: {repo_id: {revision: directory}}; `gated` answers 401 GatedRepo; `requests` logs every path."""

    def __init__(self, repos: dict[str, dict[str, Path]], gated: set[str]):
        super().__init__(("127.0.0.1", 0), Handler)
        self.repos, self.gated, self.requests = repos, gated, []
        self.commits = {commit_of(r, rev): (r, d) for r, revs in repos.items() for rev, d in revs.items()}
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class Handler(http.server.BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args):  # quiet
        pass

    def do_HEAD(self):
        self.answer(body=False)

    def do_GET(self):
        self.answer(body=True)

    def send(self, status: int, data: bytes = b"", headers: dict | None = None, body: bool = True):
        self.send_response(status)
        for k, v in {"Content-Length": str(len(data)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def error(self, status: int, code: str, message: str, body: bool):
        self.send(status, json.dumps({"error": message}).encode(), {"X-Error-Code": code, "X-Error-Message": message},
                  body)  # fmt: skip

    def answer(self, body: bool):
        hub, path = self.server, unquote(urlsplit(self.path).path)
        hub.requests.append(path)
        parts = path.strip("/").split("/")
        api = parts[:2] == ["api", "models"]
        repo = "/".join(parts[2:4] if api else parts[0:2])
        kind, rev = (parts[4:6] if api else parts[2:4]) + [None] * (2 - len(parts[4:6] if api else parts[2:4]))
        if repo in hub.gated:
            return self.error(401, "GatedRepo", f"Access to model {repo} is restricted.", body)
        if repo not in hub.repos:
            return self.error(401, "RepoNotFound", "Repository Not Found", body)
        if rev in hub.repos[repo]:
            commit, folder = commit_of(repo, rev), hub.repos[repo][rev]
        elif rev in hub.commits:
            commit, folder = rev, hub.commits[rev][1]
        else:
            return self.error(404, "RevisionNotFound", f"Invalid rev id: {rev}", body)
        files = sorted(p.name for p in folder.iterdir() if p.is_file())
        if api and kind == "revision":
            info = {"id": repo, "modelId": repo, "sha": commit, "private": False, "gated": False,
                    "siblings": [{"rfilename": f} for f in files]}  # fmt: skip
            return self.send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        if api and kind == "tree":
            tree = [{"type": "file", "path": f, "size": (folder / f).stat().st_size, "oid": sha1(folder / f)}
                    for f in files]  # fmt: skip
            return self.send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
        if kind == "resolve" and "/".join(parts[4:]) in files:
            data = (folder / "/".join(parts[4:])).read_bytes()
            headers = {"ETag": f'"{hashlib.sha1(data).hexdigest()}"', "X-Repo-Commit": commit}
            return self.send(200, data, headers, body)
        return self.error(404, "EntryNotFound", f"no {path}", body)


def sha1(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def repo_dir(checkpoint_factory, tmp_path_factory) -> Path:
    """The checkpoint as a hub repository holds it, with files the loader never reads (not to be fetched)."""
    folder = tmp_path_factory.mktemp("hub-repo") / "tiny-llama"
    shutil.copytree(checkpoint_factory("llama", tokenizer=True), folder)
    (folder / "pytorch_model.bin").write_bytes(b"not fetched" * 100)
    (folder / "README.md").write_text("a model card")
    return folder


@pytest.fixture
def hub(repo_dir, tmp_path, monkeypatch):
    """A fake hub on loopback, huggingface_hub pointed at it, a fresh cache, no token, online."""
    from huggingface_hub import constants

    server = FakeHub({REPO_ID: {"main": repo_dir, "v2": repo_dir}, GATED_ID: {"main": repo_dir}}, {GATED_ID})
    threading.Thread(target=server.serve_forever, daemon=True).start()
    point_at(monkeypatch, server.url)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_PROGRESS_BARS", True, raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", True, raising=False)
    yield server
    server.shutdown()
    server.server_close()


def point_at(monkeypatch, url: str) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_line_error(model: str, **kw) -> str:
    with pytest.raises(ValueError) as info:
        resolve_path(model, **kw)
    message = str(info.value)
    assert "\n" not in message and model in message, message
    return message


def greedy(model: str, **kw) -> list[list[int]]:
    from level0_naive import LLM, SamplingParams

    llm = LLM(model, dtype="float32", device="cpu", **kw)
    outs = llm.generate([[1, 2, 3], [7, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                        progress=False)  # fmt: skip
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine.model_path


def test_downloaded_on_first_use_then_from_the_cache_offline(hub, repo_dir, monkeypatch):
    from huggingface_hub import constants

    local, _ = greedy(str(repo_dir))
    tokens, path = greedy(REPO_ID)
    assert tokens == local
    assert path.parent.name == "snapshots" and path.name == commit_of(REPO_ID, "main")
    fetched = {p.rsplit("/", 1)[-1] for p in hub.requests if "/resolve/" in p}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= fetched
    assert not fetched & {"pytorch_model.bin", "README.md"}  # only what the loader reads
    # Second use: the cache alone, the hub unreachable and downloads forbidden.
    point_at(monkeypatch, f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert greedy(REPO_ID)[0] == local


def test_revision_and_download_dir_reach_the_loader(hub, tmp_path):
    _, path = greedy(REPO_ID, revision="v2", download_dir=str(tmp_path / "dl"))
    assert path.name == commit_of(REPO_ID, "v2") and (tmp_path / "dl") in path.parents
    assert "no revision 'v9'" in one_line_error(REPO_ID, revision="v9")


def test_unknown_gated_offline_and_no_network_are_one_line_each(hub, monkeypatch):
    from huggingface_hub import constants

    assert "no repository" in one_line_error("ladder-org/no-such-model")
    gated = one_line_error(GATED_ID)
    assert "gated" in gated and "HF_TOKEN" in gated and "no token was given" in gated
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert "HF_HUB_OFFLINE" in one_line_error(REPO_ID)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    point_at(monkeypatch, f"http://127.0.0.1:{closed_port()}")
    assert "could not be reached" in one_line_error(REPO_ID)


def test_demo_flags_and_serve_positional_model(hub, tmp_path, capsys):
    from ladder.cli import demo_parser, parse_demo_args
    from level6_serving.__main__ import engine_kwargs, parse_args

    p = demo_parser("a demo", "level0_naive.demo")
    args = parse_demo_args(p, ["--model", REPO_ID, "--revision", "v2", "--download-dir", str(tmp_path / "dl")])
    assert Path(args.model).name == commit_of(REPO_ID, "v2")  # the demo hands LLM this snapshot
    assert parse_demo_args(p, ["--model", REPO_ID]).model == REPO_ID  # no revision: the name, found in the cache
    with pytest.raises(SystemExit):
        parse_demo_args(p, ["--model", "ladder-org/no-such-model"])
    assert "argument --model: model 'ladder-org/no-such-model' not found" in capsys.readouterr().err

    args = parse_args([REPO_ID, "--revision", "v2", "--port", "0"])
    assert args.model == REPO_ID and engine_kwargs(args)["revision"] == "v2"
    assert parse_args(["--model", REPO_ID]).model == REPO_ID  # the flag still works
    with pytest.raises(SystemExit):
        parse_args([REPO_ID, "--model", "tiny-shakespeare"])
    assert "differs from the positional model" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # runpy: level6_serving.__main__ was imported above
def test_every_ladder_flag_has_help(monkeypatch, capsys):
    """`ladder serve --help`, `bench`, `trace`, `watch`, each `ladder labs` command and each `ladder demo N`:
    no flag or positional without a help string."""
    import argparse

    from ladder.main import DEMOS, main

    seen = []
    monkeypatch.setattr(argparse.ArgumentParser, "print_help", lambda self, file=None: seen.append(self))
    labs = [["labs", c] for c in ("start", "check", "experiment", "run", "plant", "starters")]
    commands = [["serve"], ["bench"], ["trace"], ["watch"], *labs, *(["demo", n] for n in DEMOS)]
    for argv in commands:
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
    bare = [f"{p.prog}: {a.option_strings or a.dest}" for p in seen for a in p._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help]  # fmt: skip
    assert len(seen) == len(commands) and not bare, bare
