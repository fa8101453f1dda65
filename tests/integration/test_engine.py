"""The real local engine: vLLM's CPU build serving the tiny model we build."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from draftgen.local import EngineError, LocalEngine, build_tiny_model

PROMPTS = [
    [{"role": "user", "content": "Explain what a key-value cache is."}],
    [
        {"role": "system", "content": "You are a careful programmer."},
        {"role": "user", "content": "def fibonacci(n: int) -> int:"},
    ],
    [{"role": "user", "content": "用户：什么是键值缓存？ Réponds en français, s'il te plaît."}],
]


def post_json(url: str, body: dict[str, Any], timeout_s: float = 60) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        reply: dict[str, Any] = json.load(response)
    return reply


def stream_events(url: str, body: dict[str, Any], timeout_s: float = 60) -> list[dict[str, Any]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    events: list[dict[str, Any]] = []
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return events
            events.append(json.loads(data))
    raise AssertionError("stream ended without [DONE]")


def chat_body(messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def test_chat_completion_gives_exactly_max_tokens(local_engine: LocalEngine) -> None:
    reply = post_json(
        f"{local_engine.url}/v1/chat/completions", chat_body(PROMPTS[0], return_token_ids=True)
    )
    choice = reply["choices"][0]
    assert reply["usage"]["completion_tokens"] == 16
    assert len(choice["token_ids"]) == 16
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"]


def test_streamed_completion_matches_the_whole_one(local_engine: LocalEngine) -> None:
    url = f"{local_engine.url}/v1/chat/completions"
    whole = post_json(url, chat_body(PROMPTS[0]))
    events = stream_events(
        url, chat_body(PROMPTS[0], stream=True, stream_options={"include_usage": True})
    )
    text = "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")
    )
    finish = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
    assert events[-1]["usage"]["completion_tokens"] == 16
    assert finish[-1] == "length"
    # Greedy decoding: streaming must not change the text, only how it arrives.
    assert text == whole["choices"][0]["message"]["content"]


def test_greedy_output_matches_transformers(
    local_engine: LocalEngine, tiny_model_dir: Path
) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    model.eval()
    # What draftgen uses for prompt token counts: the bare tokenizer.json.
    bare = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    n_new = 24
    exact = total = 0
    for messages in PROMPTS:
        reply = post_json(
            f"{local_engine.url}/v1/chat/completions",
            chat_body(messages, max_tokens=n_new, return_token_ids=True),
        )
        served = reply["choices"][0]["token_ids"]
        rendered = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        prompt_ids = bare.encode(rendered).ids
        assert reply["usage"]["prompt_tokens"] == len(prompt_ids)
        assert reply["prompt_token_ids"] in (None, prompt_ids)

        ids = list(prompt_ids)
        for step, token in enumerate(served):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].float()
            best = float(logits.max())
            # bf16 logits carry 8 significant bits, so the top two often tie within a unit
            # in the last place, and two kernels may round such a tie either way. A token
            # further from the maximum than that is a real disagreement.
            gap = best - float(logits[token])
            assert gap <= abs(best) / 64, (
                f"vLLM chose token {token} at step {step}, {gap:.4f} below transformers' best "
                f"{int(logits.argmax())} ({best:.4f}); prompt {messages!r}"
            )
            exact += int(token == int(logits.argmax()))
            total += 1
            # Follow vLLM's choice so a tie early on does not end the comparison.
            ids.append(token)
    # Guards against a degenerate model whose logits are all equal, where any token passes.
    assert exact >= 0.75 * total, f"only {exact} of {total} greedy tokens agree exactly"


def test_served_model_is_a_fresh_build(tiny_model_dir: Path, tmp_path: Path) -> None:
    fresh = build_tiny_model(tmp_path / "fresh")
    names = sorted(p.name for p in tiny_model_dir.iterdir())
    assert names == sorted(p.name for p in fresh.iterdir())
    for name in names:
        assert (tiny_model_dir / name).read_bytes() == (fresh / name).read_bytes(), name


def test_tokenize_endpoint_counts_like_tokenizer_json(
    local_engine: LocalEngine, tiny_model_dir: Path
) -> None:
    from tokenizers import Tokenizer

    text = "The ledger is the truth; writes are atomic. 数据集生成需要稳定。"
    reply = post_json(f"{local_engine.url}/tokenize", {"model": "tiny", "prompt": text})
    bare = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert reply["tokens"] == bare.encode(text).ids
    assert reply["max_model_len"] == 4096


def test_start_failure_reports_the_engine_log(engine_installed: None, tmp_path: Path) -> None:
    engine = LocalEngine(tmp_path / "no-such-model", log_path=tmp_path / "vllm.log")
    with pytest.raises(EngineError) as excinfo:
        engine.start(timeout_s=120)
    message = str(excinfo.value)
    assert "exited with code" in message
    assert str(tmp_path / "vllm.log") in message
    assert "no-such-model" in message
    assert engine.pid is None
