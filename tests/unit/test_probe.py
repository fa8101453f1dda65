"""The A/B probe against stand-in servers that answer like vLLM and SGLang.

The stand-ins serve one small deterministic "model" (a next-token distribution computed from
the context), so two stand-ins with the same model must agree exactly, and a stand-in whose
logits carry added noise is a candidate with known, adjustable drift. Each runs on its own
event loop in a thread, so the same server serves async tests and `probe_command` (which
calls `asyncio.run` itself).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from draftgen.errors import JobError
from draftgen.probe import (
    Position,
    ProbeError,
    ProbeThresholds,
    compare_prompt,
    load_prompts,
    matching_prefix,
    probe_command,
    run_probe,
    topk_kl,
)
from draftgen.probe import command as probe_module
from draftgen.probe.command import DEMO_PROMPTS_DIR
from draftgen.probe.servers import Http, VllmServer

VOCAB = 48
BOS = 1


@dataclass
class FakeModel:
    noise: float = 0.0  # standard deviation of the noise added to each logit

    def logprobs(self, context: Sequence[int]) -> list[float]:
        key = f"{context[-1]}-{context[-2] if len(context) > 1 else -1}-{len(context) % 5}"
        rng = random.Random(key)
        logits = [rng.gauss(0.0, 2.5) for _ in range(VOCAB)]
        if self.noise:
            jitter = random.Random("noise" + key)
            logits = [x + self.noise * jitter.gauss(0.0, 1.0) for x in logits]
        top = max(logits)
        norm = top + math.log(sum(math.exp(x - top) for x in logits))
        return [x - norm for x in logits]

    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            lps = self.logprobs(ids)
            ids.append(max(range(VOCAB), key=lps.__getitem__))
        return ids[len(prompt):]


def render(messages: Sequence[dict[str, str]]) -> list[int]:
    text = "".join(f"{m['role']}:{m['content']}\n" for m in messages) + "assistant:"
    return [BOS] + [3 + ord(c) % (VOCAB - 3) for c in text]


def ranked(lps: list[float]) -> list[int]:
    return sorted(range(VOCAB), key=lambda t: -lps[t])


@dataclass
class StandIn:
    """A server of one flavour: "vllm", "sglang", or "sglang-old" (no output_ids)."""

    flavour: str
    model: FakeModel = field(default_factory=FakeModel)
    seen: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        if self.flavour == "vllm":
            app.router.add_get("/v1/models", self._models)
            app.router.add_post("/tokenize", self._tokenize)
            app.router.add_post("/v1/completions", self._completions)
        else:
            app.router.add_get("/get_model_info", self._model_info)
            app.router.add_post("/v1/chat/completions", self._chat)
            app.router.add_post("/generate", self._generate)
        return app

    async def _body(self, request: web.Request) -> dict[str, Any]:
        body: dict[str, Any] = await request.json()
        self.seen.append((request.path, body | {"_auth": request.headers.get("Authorization")}))
        return body

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake", "max_model_len": 4096}]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        ids = render(body["messages"])
        return web.json_response({"count": len(ids), "tokens": ids, "token_strs": None})

    async def _completions(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        prompt: list[int] = body["prompt"]
        k = body.get("prompt_logprobs")
        if k is not None and k > 20:  # vLLM's default --max-logprobs
            return web.json_response(
                {"error": {"message": "Requested prompt logprobs of 32, which is greater "
                           "than max allowed: 20", "code": 400}}, status=400)
        choice: dict[str, Any] = {"index": 0, "text": "", "finish_reason": "length"}
        out = self.model.greedy(prompt, body.get("max_tokens", 16))
        if body.get("return_token_ids"):
            choice["token_ids"] = out
        if k is not None:
            entries: list[Any] = [None]
            for i in range(1, len(prompt)):
                lps = self.model.logprobs(prompt[:i])
                order = ranked(lps)
                keep = {*order[:k], prompt[i]}
                entries.append({str(t): {"logprob": lps[t], "rank": order.index(t) + 1,
                                         "decoded_token": ""} for t in keep})
            choice["prompt_logprobs"] = entries
        return web.json_response({"object": "text_completion", "choices": [choice]})

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "/models/fake", "is_generation": True})

    async def _chat(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "x"}}
        if body.get("return_prompt_token_ids"):
            choice["prompt_token_ids"] = render(body["messages"])
        return web.json_response({"choices": [choice]})

    async def _generate(self, request: web.Request) -> web.Response:
        # SGLang's scheduler: logprobs for tokens input_ids[start:], the first None and the
        # rest shifted by one (the logits at i predict token i + 1); triples [lp, id, text].
        body = await self._body(request)
        ids: list[int] = body["input_ids"]
        params = body["sampling_params"]
        out = self.model.greedy(ids, params["max_new_tokens"])
        meta: dict[str, Any] = {"prompt_tokens": len(ids), "completion_tokens": len(out)}
        if body.get("return_logprob"):
            start = body.get("logprob_start_len", -1)
            k = body.get("top_logprobs_num", 0)
            span = range(start, len(ids)) if start >= 0 else range(0)
            tokens: list[Any] = []
            tops: list[Any] = []
            for pos in span:
                if pos == start:
                    tokens.append([None, ids[pos], None])
                    tops.append(None)
                    continue
                lps = self.model.logprobs(ids[:pos])
                tokens.append([lps[ids[pos]], ids[pos], None])
                tops.append([[lps[t], t, None] for t in ranked(lps)[:k]])
            meta |= {"input_token_logprobs": tokens, "input_top_logprobs": tops}
            outs, ctx = [], list(ids)
            for t in out:
                outs.append([self.model.logprobs(ctx)[t], t, None])
                ctx.append(t)
            meta["output_token_logprobs"] = outs
        reply: dict[str, Any] = {"text": "", "meta_info": meta}
        if self.flavour == "sglang":
            reply["output_ids"] = out
        return web.json_response(reply)

    def requests(self, path: str) -> list[dict[str, Any]]:
        return [b for p, b in self.seen if p == path]


@contextmanager
def serving(*servers: StandIn) -> Iterator[None]:
    loop = asyncio.new_event_loop()
    runners: list[web.AppRunner] = []

    async def start() -> None:
        for s in servers:
            runner = web.AppRunner(s.app())
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            runners.append(runner)
            s.url = f"http://127.0.0.1:{runner.addresses[0][1]}"

    async def stop() -> None:
        for r in runners:
            await r.cleanup()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(start(), loop).result(10)
        yield
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


PROMPTS = [[{"role": "user", "content": f"question number {i}: {'why ' * (i % 4)}?"}]
           for i in range(12)]


async def probe(ref: StandIn, cand: StandIn, **kw: Any) -> Any:
    args: dict[str, Any] = dict(n=10, max_tokens=12, top_k=8, model=None,
                                thresholds=ProbeThresholds())
    args.update(kw)
    return await run_probe(ref.url, cand.url, PROMPTS, **args)


# --- whole probes ----------------------------------------------------------------------------


async def test_identical_servers_report_no_divergence() -> None:
    ref, cand = StandIn("vllm"), StandIn("vllm")
    with serving(ref, cand):
        result = await probe(ref, cand)
    assert result.engines == ("vllm", "vllm")
    assert result.model == "fake"
    assert len(result.details) == 10 and result.positions == 120
    assert result.mean_kl == 0.0 and result.max_kl == 0.0
    assert result.top1_agreement == 1.0 and result.reference_top1 == 1.0
    assert result.exact_match_rate == 1.0 and result.mean_matching_prefix == 12
    assert result.mean_first_divergence is None
    assert result.passed and result.verdict_line().startswith("PASS")
    # Every request carried the model name the server itself reported.
    assert all(b["model"] == "fake" for _, b in cand.seen)


async def test_perturbed_candidate_shows_larger_divergence_and_fails() -> None:
    ref, slight, strong = StandIn("vllm"), StandIn("vllm", FakeModel(0.05)), StandIn(
        "vllm", FakeModel(1.5))
    with serving(ref, slight, strong):
        small = await probe(ref, slight)
        large = await probe(ref, strong)
    assert 0.0 < small.mean_kl < 0.01 < large.mean_kl
    assert small.passed
    assert large.top1_agreement < 0.9
    assert large.exact_match_rate < 1.0
    assert not large.passed
    assert any("mean KL" in f for f in large.failures)
    assert any("top-1" in f for f in large.failures)
    assert large.verdict_line().startswith("FAIL")
    # The reference is still self-consistent: drift is the candidate's alone.
    assert large.reference_top1 == 1.0


async def test_first_divergence_is_where_greedy_outputs_part() -> None:
    ref, cand = StandIn("vllm"), StandIn("vllm", FakeModel(1.5))
    with serving(ref, cand):
        result = await probe(ref, cand)
    for d in result.details:
        ref_out = FakeModel().greedy(render(PROMPTS[d.index]), 12)
        cand_out = FakeModel(1.5).greedy(render(PROMPTS[d.index]), 12)
        assert d.matching_prefix == matching_prefix(ref_out, cand_out)
        assert d.exact_match == (ref_out == cand_out)
        assert d.first_divergence == (None if d.exact_match else d.matching_prefix)
    diverged = [d.matching_prefix for d in result.details if not d.exact_match]
    assert diverged
    assert result.mean_first_divergence == pytest.approx(sum(diverged) / len(diverged))


async def test_sglang_generate_path_scores_the_continuation() -> None:
    ref, cand = StandIn("sglang"), StandIn("sglang")
    with serving(ref, cand):
        result = await probe(ref, cand, n=3)
    assert result.engines == ("sglang", "sglang")
    assert result.mean_kl == 0.0 and result.top1_agreement == 1.0 and result.passed
    prompt = render(PROMPTS[0])
    cont = FakeModel().greedy(prompt, 12)
    scoring = [b for b in cand.requests("/generate")
               if b["sampling_params"]["max_new_tokens"] == 0]
    assert len(scoring) == 3
    first = next(b for b in scoring if b["input_ids"][: len(prompt)] == prompt)
    assert first["input_ids"] == prompt + cont
    assert first["logprob_start_len"] == len(prompt) - 1
    assert first["top_logprobs_num"] == 8 and first["return_logprob"] is True
    # The prompt was rendered once, by the reference's chat endpoint, not by the candidate.
    assert len(ref.requests("/v1/chat/completions")) == 3
    assert not cand.requests("/v1/chat/completions")


async def test_vllm_reference_and_sglang_candidate_align_position_by_position() -> None:
    # Same model behind different APIs: any off-by-one in either alignment shows as KL.
    ref, cand = StandIn("vllm"), StandIn("sglang-old")
    with serving(ref, cand):
        result = await probe(ref, cand)
    assert result.engines == ("vllm", "sglang")
    assert result.mean_kl == pytest.approx(0.0, abs=1e-12)
    assert result.top1_agreement == 1.0 and result.exact_match_rate == 1.0


async def test_sglang_candidate_with_drift_is_measured() -> None:
    ref, cand = StandIn("sglang"), StandIn("sglang", FakeModel(1.5))
    with serving(ref, cand):
        result = await probe(ref, cand)
    assert result.mean_kl > 0.01 and not result.passed


async def test_exact_match_threshold_is_optional() -> None:
    ref, cand = StandIn("vllm"), StandIn("vllm", FakeModel(0.3))
    with serving(ref, cand):
        loose = await probe(ref, cand, thresholds=ProbeThresholds(1.0, 0.0))
        strict = await probe(ref, cand, thresholds=ProbeThresholds(1.0, 0.0, 1.0))
    assert loose.exact_match_rate < 1.0
    assert loose.passed
    assert not strict.passed and strict.failures == (
        f"exact match {strict.exact_match_rate:.0%} < 100%",)


async def test_api_key_is_sent_to_both_servers() -> None:
    ref, cand = StandIn("vllm"), StandIn("sglang")
    with serving(ref, cand):
        await probe(ref, cand, n=1, api_key="sk-test")
    assert {b["_auth"] for _, b in ref.seen + cand.seen} == {"Bearer sk-test"}


async def test_server_error_names_the_server_and_its_message() -> None:
    ref, cand = StandIn("vllm"), StandIn("vllm")
    with serving(ref, cand), pytest.raises(ProbeError) as err:
        await probe(ref, cand, top_k=32)
    assert "HTTP 400" in str(err.value) and "max allowed: 20" in str(err.value)
    assert "/v1/completions" in str(err.value)


async def test_unreachable_server_is_a_probe_error() -> None:
    ref = StandIn("vllm")
    with serving(ref):
        dead = ref.url
    with pytest.raises(ProbeError, match="get_model_info"):
        await run_probe(dead, dead, PROMPTS, n=1, max_tokens=4, top_k=4, model="m",
                        thresholds=ProbeThresholds())


async def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        await run_probe("http://x", "http://y", PROMPTS, n=0, max_tokens=4, top_k=4,
                        model=None, thresholds=ProbeThresholds())


# --- the estimator -----------------------------------------------------------------------------


def test_topk_kl_of_identical_positions_is_zero() -> None:
    p = Position(5, math.log(0.4), 5, {5: math.log(0.4), 6: math.log(0.3)})
    assert topk_kl(p, p) == 0.0


def test_topk_kl_uses_shared_cells_and_one_rest_cell() -> None:
    # Reference top-2 {a: .5, b: .3}; candidate top-2 {a: .4, c: .35}, b = .1 (forced).
    a, b, c = 10, 11, 12
    ref = Position(b, math.log(0.3), a, {a: math.log(0.5), b: math.log(0.3)})
    cand = Position(b, math.log(0.1), a, {a: math.log(0.4), c: math.log(0.35)})
    # Cells: a (shared), b (forced token), rest = .2 vs .5.
    expected = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.1) + 0.2 * math.log(0.2 / 0.5)
    assert topk_kl(ref, cand) == pytest.approx(expected)


def test_topk_kl_is_a_lower_bound_that_tightens_with_k() -> None:
    rng = random.Random(7)
    for _ in range(20):
        ctx = [rng.randrange(VOCAB) for _ in range(3)]
        p, q = FakeModel().logprobs(ctx), FakeModel(0.8).logprobs(ctx)
        full = sum(math.exp(a) * (a - b) for a, b in zip(p, q, strict=True))
        token = ranked(p)[0]
        bounds = []
        for k in (1, 4, 16, VOCAB):
            ref = Position(token, p[token], token, {t: p[t] for t in ranked(p)[:k]})
            cand = Position(token, q[token], ranked(q)[0], {t: q[t] for t in ranked(q)[:k]})
            bounds.append(topk_kl(ref, cand))
        assert all(x <= full + 1e-9 for x in bounds)
        assert bounds[-1] == pytest.approx(full, rel=1e-6)
        assert bounds[2] >= bounds[0] - 1e-12


def test_topk_kl_refuses_positions_of_different_tokens() -> None:
    with pytest.raises(ValueError):
        topk_kl(Position(1, -1.0, 1, {}), Position(2, -1.0, 2, {}))


def test_tied_argmax_counts_as_agreement() -> None:
    # bf16 logits tie: the sampler took 7, the ranking names 9 first; both are the max.
    ref = Position(7, -1.0, 9, {9: -1.0, 7: -1.0, 3: -2.0})
    same = Position(7, -1.0, 9, {9: -1.0, 7: -1.0, 3: -2.0})
    moved = Position(7, -1.5, 3, {3: -0.5, 9: -1.4, 7: -1.5})
    tied = compare_prompt(0, 5, [7], [7], [ref], [same])
    assert tied.top1_hits == 1 and tied.reference_top1_hits == 1
    assert compare_prompt(0, 5, [7], [7], [ref], [moved]).top1_hits == 0
    strict = Position(7, -1.2, 9, {9: -1.0, 7: -1.2})
    assert compare_prompt(0, 5, [7], [7], [strict], [strict]).reference_top1_hits == 0


def test_vllm_prompt_logprobs_entry_keeps_the_top_k_and_the_forced_token() -> None:
    server = VllmServer(Http(None, None), "http://x", None)  # type: ignore[arg-type]
    entry = {"5": {"logprob": -0.5, "rank": 1, "decoded_token": ""},
             "6": {"logprob": -1.5, "rank": 2, "decoded_token": ""},
             "8": {"logprob": -6.0, "rank": 40, "decoded_token": "x"}}
    pos = server._position(entry, 8, 2)
    assert pos == Position(8, -6.0, 5, {5: -0.5, 6: -1.5})
    with pytest.raises(ProbeError, match="no logprob for token 9"):
        server._position(entry, 9, 2)


def test_matching_prefix() -> None:
    assert matching_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert matching_prefix([1, 2, 3], [1, 9, 3]) == 1
    assert matching_prefix([1, 2], [1, 2, 3]) == 2
    assert matching_prefix([], [4]) == 0


# --- prompts and the command -------------------------------------------------------------------


def test_default_prompts_take_every_demo_category_in_turn() -> None:
    files = sorted(DEMO_PROMPTS_DIR.glob("*.jsonl"))
    assert len(files) >= 2
    set_aside: list[str] = []
    prompts = load_prompts(None, set_aside)
    firsts = [load_prompts(f)[0] for f in files]
    assert prompts[: len(files)] == firsts
    assert len(prompts) == sum(len(load_prompts(f)) for f in files)
    # The demo keeps a few broken rows on purpose; they are set aside with their place.
    assert set_aside and all(".jsonl:" in r for r in set_aside)


def test_builtin_prompts_outside_a_source_checkout(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    monkeypatch.setattr(probe_module, "DEMO_PROMPTS_DIR", tmp_path)
    prompts = load_prompts(None)
    assert len(prompts) == len(probe_module.BUILTIN_PROMPTS)
    assert all(p[0]["role"] == "user" and p[0]["content"] for p in prompts)


def test_prompt_file_rows_are_checked_and_cut_to_the_last_user_turn(tmp_path: Path) -> None:
    good = tmp_path / "p.jsonl"
    good.write_text(json.dumps({"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}) + "\n\n")
    assert load_prompts(good) == [[{"role": "user", "content": "a"},
                                   {"role": "assistant", "content": "b"},
                                   {"role": "user", "content": "c"}]]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"messages": [{"role": "user", "content": "ok"}]}\n{"text": "x"}\n'
                     '{"conversations": [{"from": "human", "value": "hi"}]}\n'
                     '{"question": "why?"}\n')
    set_aside: list[str] = []
    assert load_prompts(mixed, set_aside) == [[{"role": "user", "content": "ok"}],
                                              [{"role": "user", "content": "hi"}],
                                              [{"role": "user", "content": "why?"}]]
    assert len(set_aside) == 1 and set_aside[0].startswith(f"{mixed}:2: missing_field")
    useless = tmp_path / "useless.jsonl"
    useless.write_text('{"messages": []}\n{oops\n')
    with pytest.raises(JobError, match="no usable prompt rows"):
        load_prompts(useless)
    with pytest.raises(JobError, match="cannot read"):
        load_prompts(tmp_path / "missing.jsonl")


def test_probe_command_exit_codes_and_json(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"messages": m}) + "\n" for m in PROMPTS[:4]))
    ref, twin, drifted = StandIn("vllm"), StandIn("vllm"), StandIn("vllm", FakeModel(1.5))
    out = tmp_path / "probe.json"
    with serving(ref, twin, drifted):
        assert probe_command(ref.url, twin.url, prompts, 4, 8, 5, out) == 0
        printed = capsys.readouterr().out
        assert "mean top-k KL" in printed and printed.rstrip().splitlines()[-1].startswith("PASS")
        data = json.loads(out.read_text())
        assert data["passed"] is True and data["mean_kl"] == 0.0 and len(data["details"]) == 4
        assert data["details"][0]["first_divergence"] is None
        assert probe_command(ref.url, drifted.url, prompts, 4, 8, 5, None) == 1
        assert "FAIL" in capsys.readouterr().out
        dead = ref.url
    assert probe_command(ref.url, twin.url, tmp_path / "none.jsonl", 4, 8, 5, None) == 2
    assert "cannot read" in capsys.readouterr().err
    assert probe_command(dead, dead, prompts, 4, 8, 5, None) == 2
    assert "probe:" in capsys.readouterr().err
    assert probe_command(dead, dead, prompts, 0, 8, 5, None) == 2
