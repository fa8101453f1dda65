"""The A/B probe against stand-in servers that answer like vLLM and SGLang.

The stand-ins serve one small deterministic "model" (a next-token distribution computed from
the context), so two stand-ins with the same model must agree exactly, and a stand-in whose
logits carry added noise is a candidate with known, adjustable drift. Each runs on its own
event loop in a thread, so the same server serves async tests and `probe_command` (which
calls `asyncio.run` itself).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from draftgen.engines.scoring import Http
from draftgen.engines.vllm.scoring import VllmServer
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
from draftgen.probe.drift import format_report
from draftgen.probe.gate import GateSettings
from helpers.scoring_standin import PROMPTS, VOCAB, FakeModel, StandIn, ranked, render, serving


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
    # The slight drift is within the fixed prefill thresholds, but the gate sees it is
    # beyond the reference's own noise (which is none here)...
    assert not small.failures and small.gate is not None and not small.gate.passed
    # ...and passes where the gate tolerates that much mean KL and top-1 loss.
    with serving(ref, slight):
        tolerated = await probe(ref, slight, gate=GateSettings(kl_margin=0.01,
                                                               top1_margin=0.2))
    assert tolerated.passed
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
        result = await probe(ref, cand, n=3, gate=None)  # the prefill path's requests
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
        # The prefill path's fixed thresholds alone (the gate would see this drift).
        loose = await probe(ref, cand, thresholds=ProbeThresholds(1.0, 0.0), gate=None)
        strict = await probe(ref, cand, thresholds=ProbeThresholds(1.0, 0.0, 1.0), gate=None)
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


# --- the gate: decode and cache-read paths against the reference's own noise ---------------


@pytest.mark.parametrize("flavour", ["vllm", "sglang"])
async def test_a_candidate_that_decodes_differently_fails_the_gate_not_the_old_probe(
    flavour: str,
) -> None:
    # Scores identically in prefill, decodes from perturbed logits: the blind spot of a
    # prefill-only probe (a lossy KV cache that SGLang's prefill never reads).
    ref, blind = StandIn(flavour), StandIn(flavour, FakeModel(decode_noise=0.3))
    with serving(ref, blind):
        old = await probe(ref, blind, gate=None)
        new = await probe(ref, blind)
    assert old.mean_kl == 0.0 and old.top1_agreement == 1.0
    assert old.passed, "the prefill-only probe cannot see it"
    assert new.gate is not None and not new.passed
    assert any(f.startswith("decode:") for f in new.gate.failures), new.gate.failures
    # The reverse direction (the candidate scoring the reference's answer) is prefill on the
    # candidate: it sees nothing, as the old probe did.
    reverse = next(p for p in new.gate.paths if p.name == "decode, reverse")
    assert reverse.excess_kl == 0.0
    report = format_report(new)
    assert "paths checked: decode, decode, reverse, cache read (and prefill)" in report
    assert "gate FAIL" in report


async def test_identical_servers_pass_the_gate_with_a_floor_and_a_sizing() -> None:
    ref, cand = StandIn("vllm"), StandIn("vllm")
    with serving(ref, cand):
        result = await probe(ref, cand)
    gate = result.gate
    assert gate is not None and gate.passed and result.passed
    assert [p.name for p in gate.paths] == ["decode", "decode, reverse", "cache read"]
    assert all(p.excess_kl == 0.0 and p.positions > 0 for p in gate.paths)
    assert gate.reference_repeat_match == 1.0
    assert gate.prompts_needed == 2  # no spread at all: any excess is seen at once
    assert "to detect a mean KL excess of 0.001 at 99% confidence" in "\n".join(gate.lines())
    assert result.to_dict()["gate"]["passed"] is True


def test_the_gate_tolerates_noise_and_fails_a_consistent_excess() -> None:
    from draftgen.probe.gate import PromptPaths, judge

    def prompts(excess: float, spread: float) -> list[PromptPaths]:
        rng = random.Random(7)
        return [PromptPaths({"decode": (1e-3 + excess + rng.gauss(0, spread), 0.99,
                                        1e-3 + rng.gauss(0, spread), 0.99, 16)}, True)
                for _ in range(16)]

    settings = GateSettings(confidence=0.99)
    assert judge(prompts(0.0, 2e-4), settings, 16).passed
    assert not judge(prompts(1e-3, 2e-4), settings, 16).passed
    # An excess within the spread of 16 prompts is no evidence; the sizing says how many
    # prompts would show it.
    small = judge(prompts(5e-5, 2e-4), GateSettings(detect_kl=5e-5), 16)
    assert small.passed and small.prompts_needed is not None and small.prompts_needed > 100
    assert judge(prompts(1e-3, 2e-4), GateSettings(kl_margin=2e-3), 16).passed


async def test_a_recorded_reference_sees_the_decode_blind_spot_too() -> None:
    # draftgen tune records the reference once and meets each candidate later: the gate
    # then compares the candidate's decode step with the recording's score of the same
    # context (while its tokens follow the reference's), against the recording's own noise.
    from draftgen.tune.referee import RecordedReference, probe_against, record_reference

    ref, same, blind = (StandIn("sglang"), StandIn("sglang"),
                        StandIn("sglang", FakeModel(decode_noise=0.3)))
    with serving(ref, same, blind):
        recorded = await record_reference(ref.url, PROMPTS[:10], model=None, max_tokens=12,
                                          top_k=8)
        again = RecordedReference.from_json(recorded.to_json())
        assert len(again.decodes) == len(again.cached) == 10
        gate = GateSettings()
        ok = await probe_against(again, same.url, thresholds=ProbeThresholds(), gate=gate)
        old = await probe_against(again, blind.url, thresholds=ProbeThresholds())
        new = await probe_against(again, blind.url, thresholds=ProbeThresholds(), gate=gate)
    assert ok.passed and ok.gate is not None
    assert [p.name for p in ok.gate.paths] == ["decode", "cache read"]
    assert old.passed and old.gate is None, "prefill alone cannot see it"
    assert new.gate is not None and not new.passed
    assert any(f.startswith("decode:") for f in new.gate.failures)


async def test_without_decode_logprobs_greedy_agreement_is_judged_against_the_floor() -> None:
    ref = StandIn("vllm")
    same = StandIn("vllm", no_decode_logprobs=True)
    drifted = StandIn("vllm", FakeModel(decode_noise=0.3), no_decode_logprobs=True)
    with serving(ref, same, drifted):
        ok = await probe(ref, same)
        bad = await probe(ref, drifted)
    assert ok.gate is not None and ok.passed
    assert [p.name for p in ok.gate.paths] == ["greedy (no decode logprobs)"]
    assert bad.gate is not None and not bad.passed
    assert any(f.startswith("greedy (no decode logprobs):") for f in bad.gate.failures)
    assert "not followed" in "\n".join(bad.gate.lines())
    # The greedy path's second test is on exact matches (no top-1 is known), and the verdict
    # line says which path made it.
    assert any("exact match" in f and "top-1" not in f for f in bad.gate.failures)
    assert bad.gate.lines()[-1].startswith("gate FAIL on greedy (no decode logprobs):")
    assert ok.gate.lines()[-1].startswith("gate PASS on greedy (no decode logprobs):")
    (path,) = bad.gate.to_dict()["paths"]
    assert path["floor_not_followed"] == 0.0 < path["candidate_not_followed"]
    assert "floor_mean_kl" not in path, "the greedy path measures no KL"


async def test_the_verdict_line_names_the_paths_that_made_it() -> None:
    ref, cand = StandIn("vllm"), StandIn("vllm")
    with serving(ref, cand):
        result = await probe(ref, cand)
    assert result.gate is not None
    assert result.gate.lines()[-1].startswith("gate PASS on decode, decode, reverse, cache read:")


@pytest.mark.parametrize("flavour", ["vllm", "sglang"])
async def test_a_recorded_reference_judges_a_candidate_without_decode_logprobs(
        flavour: str) -> None:
    # draftgen tune's speculative candidates are the ones whose decode may return no
    # logprobs: their greedy tokens against the recording's, with the floor the recording's
    # two decodes of each prompt.
    from draftgen.tune.referee import RecordedReference, probe_against, record_reference

    ref = StandIn(flavour)
    same = StandIn(flavour, no_decode_logprobs=True)
    drifted = StandIn(flavour, FakeModel(decode_noise=0.3), no_decode_logprobs=True)
    with serving(ref, same, drifted):
        recorded = RecordedReference.from_json((await record_reference(
            ref.url, PROMPTS[:10], model=None, max_tokens=12, top_k=8)).to_json())
        assert recorded.again == recorded.outputs
        gate = GateSettings()
        ok = await probe_against(recorded, same.url, thresholds=ProbeThresholds(), gate=gate)
        bad = await probe_against(recorded, drifted.url, thresholds=ProbeThresholds(),
                                  gate=gate)
    assert ok.gate is not None and ok.passed, ok.gate
    assert [p.name for p in ok.gate.paths] == ["greedy (no decode logprobs)"]
    assert ok.gate.reference_repeat_match == 1.0
    assert bad.gate is not None and not bad.passed
    assert any(f.startswith("greedy (no decode logprobs):") for f in bad.gate.failures)
