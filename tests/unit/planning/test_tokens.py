"""Prompt token counts: a real (tiny, trained here) tokenizer, and the character estimate."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from draftgen.errors import JobError
from draftgen.job import JobSpec
from draftgen.planning.tokens import ESTIMATE_LABEL, MESSAGE_OVERHEAD_TOKENS, TokenCounter

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a lazy afternoon by the river with a quick lunch",
    "foxes and dogs are not the best of friends",
    "over the hills and far away the river runs",
] * 20


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"]))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def msgs(*texts: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": t} for t in texts]


def job(**kw: object) -> JobSpec:
    return JobSpec.model_validate(
        {
            "model": "m",
            "partitions": {"p": {"max_tokens": 8}},
            "categories": [{"name": "c", "source": {"path": "x.jsonl"}}],
            **kw,
        }
    )


def test_estimate_is_quarter_chars_rounded_up_plus_overhead_per_message() -> None:
    c = TokenCounter.estimate()
    assert not c.exact and c.label == ESTIMATE_LABEL
    assert c.count_messages(msgs("abcde")) == 2 + MESSAGE_OVERHEAD_TOKENS
    assert c.count_messages(msgs("abcd", "")) == 1 + 0 + 2 * MESSAGE_OVERHEAD_TOKENS
    text = "x" * 1001
    assert c.count_messages(msgs(text)) == math.ceil(1001 / 4) + MESSAGE_OVERHEAD_TOKENS


def test_tokenizer_counts_exactly(tokenizer_file: Path) -> None:
    c = TokenCounter.from_path(tokenizer_file)
    ref = Tokenizer.from_file(str(tokenizer_file))
    texts = ["the quick brown fox", "over the river and far away the lazy dogs run"]
    expected = sum(len(ref.encode(t, add_special_tokens=False).ids) for t in texts)
    assert c.exact and c.warning is None and c.label.startswith("tokenizer")
    assert c.count_messages(msgs(*texts)) == expected + 2 * MESSAGE_OVERHEAD_TOKENS
    # The trained vocabulary merges whole words, so the exact count differs from chars/4.
    assert c.count_messages(msgs(*texts)) != TokenCounter.estimate().count_messages(msgs(*texts))


def test_directory_holding_tokenizer_json(tokenizer_file: Path) -> None:
    c = TokenCounter.from_path(tokenizer_file.parent)
    assert c.exact
    assert c.count_messages(msgs("the dog")) == TokenCounter.from_path(
        tokenizer_file
    ).count_messages(msgs("the dog"))


def test_followups_count_as_more_user_messages(tokenizer_file: Path) -> None:
    for c in (TokenCounter.estimate(), TokenCounter.from_path(tokenizer_file)):
        base = msgs("the quick brown fox")
        assert c.count_prompt(base, ["over the hills"]) == c.count_messages(
            [*base, *msgs("over the hills")]
        )
        assert c.count_prompt(base) == c.count_messages(base)


def test_count_many_matches_one_at_a_time_across_chunks(
    tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import draftgen.planning.tokens

    monkeypatch.setattr(draftgen.planning.tokens, "ENCODE_CHUNK_CHARS", 20)
    prompts = [(msgs(f"the lazy dog {i}", "x" * i), [f"fox {i}"] * (i % 3)) for i in range(10)]
    for c in (TokenCounter.estimate(), TokenCounter.from_path(tokenizer_file)):
        assert c.count_many(prompts) == [c.count_prompt(m, f) for m, f in prompts]


def test_a_named_tokenizer_that_cannot_be_loaded_is_a_job_error(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(JobError, match=r"tokenizer: cannot load .*tokenizer\.json"):
        TokenCounter.from_path(bad)
    with pytest.raises(JobError, match=r"tokenizer: no tokenizer file .*nothing-here"):
        TokenCounter.from_path(tmp_path / "nothing-here")
    # A directory without a tokenizer.json in it names the file it looked for.
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(JobError, match=r"no tokenizer file .*empty/tokenizer\.json"):
        TokenCounter.from_path(empty)


def test_from_job_resolves_tokenizer_relative_to_job_file(tokenizer_file: Path) -> None:
    j = job(tokenizer="tokenizer.json")
    j._base_dir = tokenizer_file.parent
    c = TokenCounter.from_job(j)
    assert c.exact and "tokenizer.json" in c.label
    assert not TokenCounter.from_job(job()).exact
