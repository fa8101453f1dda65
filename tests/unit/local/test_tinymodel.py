"""The tiny model build: complete, well-formed, byte-identical, and reused when it can be."""

from __future__ import annotations

import itertools
import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from draftgen.local import tinymodel
from draftgen.local.rounded import build_rounded_model
from draftgen.local.tinymodel import build_tiny_model

EXPECTED_FILES = {
    "config.json",
    "draftgen-build.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def read_safetensors(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header: dict[str, Any] = json.loads(raw[8 : 8 + n])
    return header, raw[8 + n :]


def bf16_values(data: bytes) -> list[float]:
    # A bf16 value is the top half of the float32 with the same bits.
    return [struct.unpack("<f", b"\0\0" + data[i : i + 2])[0] for i in range(0, len(data), 2)]


def test_builds_every_file_a_server_needs(model_dir: Path) -> None:
    assert {p.name for p in model_dir.iterdir()} == EXPECTED_FILES
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["max_position_embeddings"] == 4096
    assert config["vocab_size"] == 4096
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "add_generation_prompt" in tok_config["chat_template"]


def test_two_builds_are_byte_identical(model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    for name in EXPECTED_FILES:
        assert (model_dir / name).read_bytes() == (again / name).read_bytes(), name


def test_safetensors_holds_a_small_llama(model_dir: Path) -> None:
    header, data = read_safetensors(model_dir / "model.safetensors")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    assert header["__metadata__"] == {"format": "pt"}
    assert tensors["model.embed_tokens.weight"]["shape"] == [4096, 256]
    assert tensors["lm_head.weight"]["shape"] == [4096, 256]
    assert tensors["model.layers.1.self_attn.k_proj.weight"]["shape"] == [128, 256]
    assert tensors["model.layers.1.mlp.down_proj.weight"]["shape"] == [256, 512]
    params = 0
    spans = []
    for meta in tensors.values():
        assert meta["dtype"] == "BF16"
        start, end = meta["data_offsets"]
        assert end - start == 2 * math.prod(meta["shape"])
        params += math.prod(meta["shape"])
        spans.append((start, end))
    spans.sort()
    # Tensors tile the data region exactly: no gaps, no overlaps, nothing after.
    assert spans[0][0] == 0
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert spans[-1][1] == len(data)
    assert params == 3_278_080


def test_weights_are_zero_mean_and_norms_are_one(model_dir: Path) -> None:
    header, data = read_safetensors(model_dir / "model.safetensors")
    start, _ = header["model.layers.0.mlp.up_proj.weight"]["data_offsets"]
    values = bf16_values(data[start : start + 2 * 20_000])
    mean = sum(values) / len(values)
    rms = math.sqrt(sum(v * v for v in values) / len(values))
    assert abs(mean) < 0.002
    assert 0.045 < rms < 0.065
    assert all(2**-7 <= abs(v) < 2**-3 for v in values)
    start, end = header["model.norm.weight"]["data_offsets"]
    assert bf16_values(data[start:end]) == [1.0] * 256


def test_tokenizer_round_trips_any_text(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 4096
    config = json.loads((model_dir / "config.json").read_text())
    assert tokenizer.token_to_id("<|im_end|>") == config["eos_token_id"]
    text = "def f(x):\n    return x  # ok 🚀 数据集 Ünïcödé ∑ \t\x00 never-seen-word"
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text
    # Trained merges make common English far shorter than its bytes.
    assert len(tokenizer.encode("The server answers the request").ids) < 10


def test_a_complete_build_is_reused(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_run(*args: object) -> None:
        raise AssertionError("rebuilt a complete model")

    monkeypatch.setattr(tinymodel, "_write_tokenizer", must_not_run)
    assert build_tiny_model(model_dir) == model_dir


def test_other_parameters_rebuild(tmp_path: Path, model_dir: Path) -> None:
    out = build_tiny_model(tmp_path / "m", seed=0)
    build_tiny_model(out, seed=1)
    stamp = json.loads((out / "draftgen-build.json").read_text())
    assert stamp["seed"] == 1
    assert (out / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    assert (out / "model.safetensors").read_bytes() != (
        model_dir / "model.safetensors"
    ).read_bytes()


def test_a_failed_build_keeps_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = build_tiny_model(tmp_path / "m", seed=0)
    before = (out / "model.safetensors").read_bytes()

    def disk_full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tinymodel, "write_safetensors", disk_full)
    with pytest.raises(OSError):
        build_tiny_model(out, seed=1)
    assert json.loads((out / "draftgen-build.json").read_text())["seed"] == 0
    assert (out / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_a_build_without_its_stamp_is_redone(tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path / "m")
    (out / "draftgen-build.json").unlink()
    (out / "model.safetensors").write_bytes(b"torn")
    build_tiny_model(out)
    assert (out / "model.safetensors").stat().st_size == 6_558_400


def test_a_vocabulary_the_corpus_cannot_fill_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size=200000"):
        build_tiny_model(tmp_path / "m", vocab_size=200_000)
    assert not (tmp_path / "m").exists()


def test_a_rounded_copy_keeps_the_model_and_rounds_its_matrices_to_4_bits(
    model_dir: Path, tmp_path: Path
) -> None:
    rounded = build_rounded_model(model_dir, tmp_path / "int4", bits=4)
    assert {p.name for p in rounded.iterdir()} == EXPECTED_FILES
    for name in EXPECTED_FILES - {"model.safetensors", "draftgen-build.json"}:
        assert (rounded / name).read_bytes() == (model_dir / name).read_bytes(), name
    header, data = read_safetensors(model_dir / "model.safetensors")
    header_r, data_r = read_safetensors(rounded / "model.safetensors")
    assert header_r == header  # same names, dtype (bf16), shapes and offsets
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        before, after = bf16_values(data[start:end]), bf16_values(data_r[start:end])
        if len(meta["shape"]) == 1:
            assert after == before, name  # the norms are left as they are
            continue
        # Symmetric levels q * s, |q| <= 7 (-8 at most once rounded), each value the nearest.
        step = max(map(abs, before)) / 7
        levels = {round(v / step) for v in after}
        assert len(levels) <= 16 and levels <= set(range(-8, 8)), name
        assert all(abs(a - b) <= 0.51 * step for a, b in zip(after, before, strict=True)), name
        assert after != before, name
    # Reused when built, and byte-identical when built again.
    assert build_rounded_model(model_dir, tmp_path / "int4") == rounded
    again = build_rounded_model(model_dir, tmp_path / "again", bits=4)
    weights = "model.safetensors"
    assert (again / weights).read_bytes() == (rounded / weights).read_bytes()
    # Other bits rebuild; an unbuilt source is refused.
    three = build_rounded_model(model_dir, tmp_path / "int4", bits=3)
    assert json.loads((three / "draftgen-build.json").read_text())["bits"] == 3
    assert (three / weights).read_bytes() != (again / weights).read_bytes()
    with pytest.raises(ValueError, match="no model built here"):
        build_rounded_model(tmp_path / "nothing", tmp_path / "x")
