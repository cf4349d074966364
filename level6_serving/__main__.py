"""`python -m level6_serving`: the OpenAI-compatible server, started like `vllm serve`.

    python -m level6_serving                                   # the built-in tiny Shakespeare model, port 8000
    python -m level6_serving --model models/tiny-shakespeare --port 8000 --api-key sk-local
    python -m level6_serving Qwen/Qwen3-0.6B                   # a hub id, as `vllm serve MODEL` (downloaded once)
    python -m level6_serving --speculative-config '{"model": "tiny-shakespeare-draft", "num_speculative_tokens": 4}'

Every flag is checked before any weight loads, and a bad one is one line that names it
(exit status 2). The engine is level 5's (`base.py`): `--tensor-parallel-size` and
`--pipeline-parallel-size` start that many ranks (gloo on CPUs, NCCL on GPUs). They are
passed only to an engine whose configuration has them; serving an engine without them
(switch `base.py` to level 4's), a size other than 1 is refused with a one-line error.

`--data-parallel-size N` starts N such servers as replicas, each in a process of its own, and
serves one endpoint in front of them with a router (`router.py`: round-robin, least-loaded or
prefix-aware).

What it is not: a process manager. One process, one engine thread, one event loop (with data
parallelism, one router process and N replica processes, none restarted if it dies).

Reference: vLLM `entrypoints/openai/cli_args.py` (flag names).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import re
import signal
import sys

from ladder.cli import (
    LadderParser,
    check_device_and_models,
    model_source_flags,
    nonneg_int,
    positive_float,
    positive_int,
    prog,
)

from .defaults import KEEP_ALIVE_S, MAX_REQUEST_BODY_BYTES

DTYPES = ["auto", "float32", "bfloat16", "float16", "float64"]


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535; 0: any free port)")
    return value


def model_len(text: str) -> int:
    if text.strip() == "-1":
        return -1
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not a context length (an integer >= 2, or -1)")
    return value


def byte_size(text: str) -> int:
    """`--kv-cache-memory`: bytes, or a number with KiB / MiB / GiB."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(|B|KiB|MiB|GiB)\s*", text)
    if not m or float(m[1]) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or e.g. 512MiB, 2GiB)")
    return int(float(m[1]) * {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m[2]])


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def level_or_json_object(text: str) -> int | dict:
    """`--compilation-config 3` or `--compilation-config '{"level": 3, ...}'`, as vLLM's flag."""
    return int(text) if text.strip().lstrip("-").isdigit() else json_object(text)


def parser() -> argparse.ArgumentParser:
    # No abbreviations: the router hands its command line to the replicas minus its own flags, and
    # `--data 2` would reach them as a data-parallel size of their own.
    p = LadderParser(prog=prog("level6_serving"), description=__doc__, allow_abbrev=False,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    a = p.add_argument
    a("model_tag", nargs="?", default=None, metavar="MODEL",
      help="the model, as `vllm serve MODEL` takes it: the same as --model")  # fmt: skip
    a("--model", default=None, help="checkpoint directory, built-in name or hub id such as Qwen/Qwen3-0.6B "
                                    "(downloaded on first use; default: the built-in tiny Shakespeare model)")  # fmt: skip
    model_source_flags(p)
    a("--served-model-name", nargs="+", default=None, help="the name(s) clients use in 'model' (default: --model)")
    a("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    a("--port", type=port, default=8000, help="port (default 8000; 0: any free port)")
    a("--api-key", default=None, help="require 'Authorization: Bearer KEY' (/health, /metrics, /version stay open)")
    a("--dtype", default="auto", choices=DTYPES, help="weights and KV cache dtype (default auto)")
    a("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default auto: CUDA if available")
    a("--max-model-len", type=model_len, default=None,
      help="context length (default: what the model was trained for, its tokenizer's model_max_length when that "
           "is less than its positions; -1: every position the checkpoint has)")  # fmt: skip
    a("--max-num-seqs", type=positive_int, default=256, help="sequences in one batch (default 256)")
    a("--max-num-batched-tokens", type=positive_int, default=2048, help="token budget of one step (default 2048)")
    a("--block-size", type=positive_int, default=16, help="tokens per KV block (default 16)")
    a("--kv-cache-memory", type=byte_size, default=None, help="KV cache budget, e.g. 512MiB (default: 1GiB on CPU)")
    a("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
      help="turn automatic prefix caching off (on by default)")  # fmt: skip
    a("--speculative-config", type=json_object, default=None,
      help='as JSON, e.g. \'{"model": "tiny-shakespeare-draft", "num_speculative_tokens": 4}\'')  # fmt: skip
    a("--enable-lora", action="store_true", help="serve LoRA adapters over the model (docs/lora.md)")
    a("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
      help="adapters served from the start, each a PEFT folder under the name clients put in 'model'")  # fmt: skip
    a("--max-loras", type=positive_int, default=1, help="adapters one step may run, each in a device slot (default 1)")
    a("--max-lora-rank", type=positive_int, default=16, help="the highest adapter rank served (default 16)")
    a("--max-cpu-loras", type=positive_int, default=None, help="adapters kept in host memory (default: --max-loras)")
    a("--fully-sharded-loras", action="store_true", help="with --tensor-parallel-size: every adapter sharded over the "
      "ranks S-LoRA's way, for four small messages per layer more (features/lora/sharded.py)")
    a("--quantization", default=None, choices=["int8", "int4"], help="the projections' weights in 8 or 4 bits "
      "(docs/quantization.md)")
    a("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8"], help="the KV cache in 8 bits (default auto: "
      "the model's dtype)")
    a("--kv-transfer-config", type=json_object, default=None,
      help='a KV connector, as JSON, e.g. \'{"kv_connector": "OffloadingConnector", '
           '"kv_connector_extra_config": {"cpu_bytes_to_use": 268435456}}\' (docs/kv_connectors.md)')  # fmt: skip
    a("--compilation-config", "-O", type=level_or_json_object, default=None,
      help="torch.compile the model: 3, or as JSON, e.g. '{\"level\": 3, \"backend\": \"inductor\"}' "
           "(default: 3 on a CPU, where it is built; eager on a GPU; docs/compiled_step.md)")  # fmt: skip
    a("--enforce-eager", action="store_true", help="never compile the model, whatever --compilation-config says")
    a("--tensor-parallel-size", type=positive_int, default=1, help="ranks that split each layer (default 1)")
    a("--pipeline-parallel-size", type=positive_int, default=1, help="ranks that split the layers (default 1)")
    a("--distributed-executor-backend", default=None, choices=["mp", "ray"],
      help="how the other ranks start: mp (processes here, the default) or ray (actors on a Ray cluster: "
           "`ray start --head` first, or a local one is started)")  # fmt: skip
    a("--enable-expert-parallel", action="store_true",
      help="a mixture of experts: whole experts per TP rank, tokens sent to them (default: every expert sliced)")
    a("--stream-interval", type=positive_int, default=1,
      help="a stream's events: each choice's first text at once, then one per this many tokens, and the last "
           "(default 1: every token; more: fewer events for the event loop, the router and the client to handle)")  # fmt: skip
    a("--max-num-waiting", type=positive_int, default=1024,
      help="queued sequences beyond which requests get 503 + Retry-After (default 1024)")  # fmt: skip
    a("--drain-timeout", type=positive_float, default=30.0,
      help="on SIGTERM, seconds in-flight requests may take before they are aborted (default 30)")  # fmt: skip
    a("--max-request-body-bytes", type=byte_size, default=MAX_REQUEST_BODY_BYTES,
      help="a larger request body gets 413 before it is read (default 8MiB; also e.g. 512KiB)")  # fmt: skip
    a("--timeout-keep-alive", type=positive_float, default=KEEP_ALIVE_S,
      help="seconds an idle kept-alive connection stays open (default 30: above the 5 s after which httpx and "
           "the openai client drop theirs, so a reused connection is never closed under a request)")  # fmt: skip
    a("--exit-on-engine-death", action=argparse.BooleanOptionalAction, default=True,
      help="when the engine dies (a worker rank killed, a step that cannot be recovered), drain and exit with "
           "status 1 so a supervisor restarts the server (default on; --no-exit-on-engine-death keeps serving "
           "503s)")  # fmt: skip
    a("--dashboard", action=argparse.BooleanOptionalAction, default=True,
      help="serve the live dashboard at /dashboard: the KV blocks, the queues, the steps (default on; "
           "--no-dashboard turns it off; behind --api-key, the page asks for the key)")  # fmt: skip
    a("--data-parallel-size", type=positive_int, default=1,
      help="run this many engine replicas, each its own process, behind one endpoint (router.py; default 1)")  # fmt: skip
    a("--router", default="prefix-aware", choices=["round-robin", "least-loaded", "prefix-aware"],
      help="with --data-parallel-size > 1: which replica gets a request (default prefix-aware)")  # fmt: skip
    a("--seed", type=nonneg_int, default=0, help="seeds every request that gives no seed (default 0)")
    a("--threads", type=positive_int, default=1, help="torch CPU threads (default 1)")
    a("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="default info")
    a("--disable-uvicorn-access-log", action="store_true", help="no log line per request")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.model_tag is not None and args.model not in (None, args.model_tag):
        p.error(f"argument --model: {args.model!r} differs from the positional model {args.model_tag!r} (give one)")
    args.model = args.model or args.model_tag
    check_device_and_models(p, args)  # a hub id is downloaded here, before the engine starts
    from level0_naive.config import EngineConfig

    from .base import LLMEngine, SpeculativeConfig  # after the cheap checks: this imports torch

    known = EngineConfig.setting_names(LLMEngine.config_parts)
    for flag in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(args, flag) != 1 and flag not in known:
            p.error(f"argument --{flag.replace('_', '-')}: {getattr(args, flag)} needs a parallel engine (level 5); "
                    f"this server wraps {LLMEngine.__module__.split('.')[0]}'s, which runs on one device")  # fmt: skip
    if args.speculative_config is not None:
        try:
            spec = SpeculativeConfig.parse(args.speculative_config)
            if spec.model is not None:
                check_device_and_models(p, argparse.Namespace(device=args.device, model=spec.model))
        except ValueError as e:
            p.error(f"argument --speculative-config: {e}")
    if args.lora_modules is not None:
        if not args.enable_lora:
            p.error("argument --lora-modules: needs --enable-lora")
        bad = [m for m in args.lora_modules if "=" not in m or not m.split("=", 1)[0] or not m.split("=", 1)[1]]
        if bad:
            p.error(f"argument --lora-modules: {bad[0]!r} is not NAME=PATH")
        names = [m.split("=", 1)[0] for m in args.lora_modules]
        if twice := sorted({n for n in names if names.count(n) > 1}):
            p.error(f"argument --lora-modules: the name {twice[0]!r} is given twice")
    if args.kv_transfer_config is not None:
        from ladder import rooms

        try:
            rooms.load("kv_connectors").parse(args.kv_transfer_config)
        except ValueError as e:
            p.error(f"argument --kv-transfer-config: {e}")
    if args.compilation_config is not None:
        from ladder import rooms

        try:
            rooms.compilation_config(args.compilation_config, args.enforce_eager)
        except ValueError as e:
            p.error(f"argument --compilation-config: {e}")
    return args


def engine_kwargs(args: argparse.Namespace) -> dict:
    from level0_naive.config import EngineConfig

    from .base import LLMEngine

    kw = dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
              kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=args.enable_prefix_caching,
              speculative_config=args.speculative_config, seed=args.seed, revision=args.revision,
              download_dir=args.download_dir, compilation_config=args.compilation_config,
              enforce_eager=args.enforce_eager, kv_transfer_config=args.kv_transfer_config,
              enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
              max_cpu_loras=args.max_cpu_loras, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
    known = EngineConfig.setting_names(LLMEngine.config_parts)
    for flag in ("tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend",
                 "enable_expert_parallel", "fully_sharded_loras"):  # passed through once the engine has them  # fmt: skip
        if flag in known:
            kw[flag] = getattr(args, flag)
    return kw


ROUTER_ONLY = ("--data-parallel-size", "--router", "--host", "--port")  # what the replicas are not given


def replica_argv(argv: list[str]) -> list[str]:
    """The command line each replica gets: everything but the router's own flags (and their values)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ROUTER_ONLY:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in ROUTER_ONLY)):
            out.append(a)
    return out


def listen(host: str, port: int):
    """The listening socket, bound before anything slow starts (a model, the replicas), so a port already
    taken is one line (exit status 2, as for a bad flag) within a second, not a traceback a minute later.
    Connections that arrive while the model loads wait in the socket's queue."""
    import errno

    from .api_server import bind

    try:
        return bind(host, port)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            parser().error(f"argument --port: port {port} is in use on {host}: pick another with --port "
                           "(0: any free port)")  # fmt: skip
        if e.errno == errno.EACCES:
            parser().error(f"argument --port: port {port} needs privileges here: pick one above 1023 with --port")
        parser().error(f"cannot listen on {host}:{port} ({e.strerror}): check --host and --port")


def serve_data_parallel(args, argv: list[str]) -> None:
    """N replicas (each `python -m level6_serving` on a free local port), and the router in front."""
    from concurrent.futures import ThreadPoolExecutor

    from .api_server import freeze_startup_heap, make_server
    from .process import ServerProcess
    from .router import build_router_app

    sock = listen(args.host, args.port)
    replicas = [ServerProcess(replica_argv(argv)) for _ in range(args.data_parallel_size)]

    def stop_starting(sig, frame):  # SIGTERM while the replicas load: still stop them (the finally below)
        raise SystemExit(143)

    previous = signal.signal(signal.SIGTERM, stop_starting)
    try:
        with ThreadPoolExecutor(len(replicas)) as pool:  # they load their models at the same time
            list(pool.map(lambda r: r.start(), replicas))
        freeze_startup_heap()  # the router relays every token: no full collection over its imports (api_server.py)
        signal.signal(signal.SIGTERM, previous)  # from here the Server's handler takes it
        app = build_router_app([r.url for r in replicas], args.router, args.api_key, args.max_request_body_bytes,
                               processes=[r.proc for r in replicas])  # fmt: skip
        host, real_port = sock.getsockname()[:2]
        print(f"serving {args.data_parallel_size} replicas ({', '.join(r.url for r in replicas)}) as one endpoint "
              f"on http://{host}:{real_port} (router: {args.router})", file=sys.stderr, flush=True)  # fmt: skip
        server = make_server(app, args.drain_timeout, args.log_level, access_log=not args.disable_uvicorn_access_log,
                             timeout_keep_alive=args.timeout_keep_alive)  # fmt: skip
        server.run(sockets=[sock])  # SIGTERM: stop accepting, let responses finish (no signal re-raised after)
    finally:  # each drains its own requests (SIGTERM), then exits: all at once
        sock.close()  # uvicorn closed it if it served; if a replica failed to start, the port is free again now
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut this short
        with ThreadPoolExecutor(len(replicas)) as pool:
            list(pool.map(lambda r: r.stop(timeout=args.drain_timeout + 30), replicas))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from .process import exit_with_parent

    exit_with_parent()  # started by a ServerProcess (a DP router's replica, a test's server): go with it
    if args.data_parallel_size > 1:
        return serve_data_parallel(args, argv)
    import torch

    from ladder.models import default_model

    from .api_server import build_app, freeze_startup_heap, make_server
    from .async_engine import AsyncLLMEngine

    sock = listen(args.host, args.port)

    torch.set_num_threads(args.threads)
    model = args.model or str(default_model())
    names = args.served_model_name or [args.model or "tiny-shakespeare"]
    try:
        engine = AsyncLLMEngine.from_engine_args(model, args.stream_interval, **engine_kwargs(args))
    except ValueError as e:  # e.g. max_model_len beyond the model's: name the flag, one line
        sock.close()  # a test that calls main() keeps this frame, and so the port, alive with its traceback
        m = re.match(r"(\w+)=", str(e))
        flag = f"argument --{m[1].replace('_', '-')}: " if m else ""
        parser().error(f"{flag}{e}")
    try:
        app = build_app(engine, names, api_key=args.api_key, max_num_waiting=args.max_num_waiting,
                        max_request_body_bytes=args.max_request_body_bytes, dashboard_on=args.dashboard,
                        lora_modules=dict(m.split("=", 1) for m in args.lora_modules or ()))  # fmt: skip
    except ValueError as e:  # a --lora-modules adapter that does not fit: one line
        sock.close()
        parser().error(f"argument --lora-modules: {e}")
    host, real_port = sock.getsockname()[:2]
    # Printed whatever the log level: the one line a user (and ServerProcess) needs.
    print(f"serving {model} as {names} on http://{host}:{real_port} (engine: {engine.engine_name})",
          file=sys.stderr, flush=True)  # fmt: skip
    if args.dashboard:
        print(f"dashboard: http://{host}:{real_port}/dashboard", file=sys.stderr, flush=True)
    server = make_server(
        app,
        args.drain_timeout,
        args.log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_keep_alive=args.timeout_keep_alive,
        exit_on_engine_death=args.exit_on_engine_death,
    )
    freeze_startup_heap()  # the model and the imports: out of every full collection's walk (api_server.py)
    server.run(sockets=[sock])
    if server.force_exit:
        # A second Ctrl-C skips uvicorn's lifespan shutdown, so engine.shutdown() never ran: not a clean
        # exit. The engine thread may still be inside a forward pass, and finalising the interpreter under
        # it aborts (torch's C++ "terminate called without an active exception", SIGABRT, now and then):
        # quitting now means skipping the finalisation too, and with it multiprocessing's, which would have
        # terminated the tensor/pipeline ranks (daemon processes): that is done here.
        for child in multiprocessing.active_children():
            child.terminate()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    # An engine that died is not a clean exit either: a supervisor restarts a process that exits non-zero.
    sys.exit(1 if server.engine_died else 0)


if __name__ == "__main__":
    main()
