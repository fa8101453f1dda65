"""The real model, made from its package: the same bytes as measured, its own chat template,
and answers a reader recognises, ending on their own, from the real engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from draftgen.client import ChatClient
from draftgen.local import LocalEngine
from draftgen.local.build import STAMP_NAME
from draftgen.local.smollm2 import WEIGHTS_SHA256, _sha256


def test_the_model_is_the_one_measured_and_carries_its_own_template(smollm2_dir: Path) -> None:
    assert _sha256(smollm2_dir / "model.safetensors") == WEIGHTS_SHA256
    assert json.loads((smollm2_dir / STAMP_NAME).read_text())["weights_sha256"] == WEIGHTS_SHA256
    config = json.loads((smollm2_dir / "config.json").read_text())
    shape = {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                    "num_key_value_heads", "vocab_size")}
    assert shape == {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "vocab_size": 49152}
    assert "quantization_config" not in config
    template = (smollm2_dir / "chat_template.jinja").read_text()
    assert "You are a helpful AI assistant named SmolLM" in template


def test_the_engine_answers_and_the_answer_ends_on_its_own(smollm2_engine: LocalEngine) -> None:
    body = {"model": "smollm2", "temperature": 0, "max_tokens": 64,
            "messages": [{"role": "user", "content": "What is the capital of France? Answer "
                                                     "in one sentence."}]}

    async def ask() -> tuple[str, str | None, int]:
        async with ChatClient() as client:
            done = await client.chat(smollm2_engine.url, body)
        return done.content, done.finish_reason, done.completion_tokens

    content, finish, tokens = asyncio.run(ask())
    assert "Paris" in content
    assert finish == "stop" and tokens < 64
