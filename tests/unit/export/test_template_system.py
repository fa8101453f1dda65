"""What the export says of rows without a system prompt depends on the model's own chat
template: SmolLM2's writes a default one the target then answered after; ChatML without one
writes none; with no template the export cannot tell and says what SpecForge's do."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import pytest

from draftgen.export.base import ExportContext, ExportOptions, Thinking, default_system
from draftgen.export.specforge import SpecForgeFormat

# SmolLM2-135M-Instruct's chat_template.jinja as transformers saves it from the GGUF.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The tiny model's: ChatML with no default.
CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
NO_SYSTEM_ROLE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise('no system') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
)


def render_with(template: str) -> Any:
    env = jinja2.Environment()

    def fail(msg: str) -> None:
        raise ValueError(msg)

    env.globals["raise"] = fail
    compiled = env.from_string(template)

    def render(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt)
    return render


@pytest.mark.parametrize("template, expected", [
    (SMOLLM2, "You are a helpful AI assistant named SmolLM, trained by Hugging Face"),
    (CHATML, None),
])
def test_the_default_system_prompt_is_read_off_the_template(template: str,
                                                           expected: str | None) -> None:
    assert default_system(render_with(template)) == expected


def test_a_template_that_refuses_a_system_message_has_no_default() -> None:
    with pytest.raises(ValueError):
        default_system(render_with(NO_SYSTEM_ROLE))


def no_system_note(render: Any) -> str:
    fmt = SpecForgeFormat()
    fmt.prepare(ExportContext(Path(), {}), ExportOptions())
    if render is not None:
        fmt.thinking = Thinking(fmt.ctx, ExportOptions(), render=render, source="m")
    rec = {"id": "c-0", "messages": [{"role": "user", "content": "q"}],
           "turns": [{"content": "a", "finish_reason": "stop"}], "finish_reason": "stop"}
    fmt.row(rec, ExportOptions())
    (note,) = [n for n in fmt.notes() if "system prompt" in n]
    return note


def test_the_export_says_what_the_model_saw_in_place_of_a_system_prompt() -> None:
    smol = no_system_note(render_with(SMOLLM2))
    assert "the model's own chat template wrote its default 'You are a helpful AI assistant " \
           "named SmolLM, trained by Hugging Face'" in smol
    assert "never saw" not in smol
    chatml = no_system_note(render_with(CHATML))
    assert "the model's chat template writes none" in chatml and "never saw" in chatml
    unknown = no_system_note(None)  # no tokenizer in the job or on the command line
    assert unknown.startswith("1 row(s) have no system prompt: SpecForge's qwen-family")
