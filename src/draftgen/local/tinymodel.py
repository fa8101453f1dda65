"""Build the tiny random-weight Llama model that the local vLLM engine serves.

No model can be downloaded here, so tests, the demo and benchmarks use a model we make: a
LlamaForCausalLM (hidden 256, 2 layers, 4 heads, 2 KV heads, ~3.3 M parameters, bf16) with a
byte-level BPE tokenizer trained on `corpus.txt`, a ChatML-style template and an end token.
Its text is gibberish; what matters is that it is a real model a real engine runs.

The weights are written straight to safetensors from a SHAKE-256 stream, using only the
standard library: the build takes a fraction of a second, needs neither torch nor numpy,
and is byte-identical on every machine and with every library version (the tokenizer
depends on the `tokenizers` version only).

`build_rounded_model` copies a built model with its weight matrices rounded to a few
levels (4 bits: 16), stored in the same dtype: the same model made lossy, which a quality
probe must tell from the original on any machine (a lossy KV cache needs hardware support).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Bump when the output of a build changes for the same parameters, so stale caches rebuild.
BUILD_VERSION = 1
STAMP_NAME = "draftgen-build.json"
CORPUS_PATH = Path(__file__).with_name("corpus.txt")

HIDDEN = 256
INTERMEDIATE = 512
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
MAX_POSITIONS = 4096

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Listed to the trainer first, so their ids are 0, 1, 2.
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)
EOS_ID = SPECIAL_TOKENS.index(IM_END)
PAD_ID = SPECIAL_TOKENS.index(END_OF_TEXT)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_BF16_ONE = b"\x80\x3f"


def build_tiny_model(out_dir: Path, *, vocab_size: int = 4096, seed: int = 0) -> Path:
    """Build the model into `out_dir` (replacing what is there) unless it is already built.

    A stamp written last records the parameters, so a complete build with the same ones is
    reused as is and an interrupted one is rebuilt.
    """
    out_dir = Path(out_dir)
    stamp = _stamp(vocab_size, seed)
    if _read_stamp(out_dir) == stamp:
        return out_dir
    with _building(out_dir, stamp) as tmp:
        _write_tokenizer(tmp, vocab_size)
        _write_json(tmp / "config.json", _model_config(vocab_size))
        _write_json(tmp / "generation_config.json", _generation_config())
        _write_safetensors(tmp / "model.safetensors", _weights(vocab_size, seed))
    return out_dir


def _stamp(vocab_size: int, seed: int) -> dict[str, Any]:
    corpus_sha = hashlib.sha256(CORPUS_PATH.read_bytes()).hexdigest()
    return {
        "build_version": BUILD_VERSION,
        "vocab_size": vocab_size,
        "seed": seed,
        "corpus_sha256": corpus_sha,
    }


def _read_stamp(out_dir: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads((out_dir / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte gets a token even if the corpus lacks it, so any text can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(CORPUS_PATH)], trainer)
    # The model's vocabulary must match exactly: a sampled id with no token would decode to
    # nothing, and the engine would report tokens that no text shows.
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the corpus yields only {tokenizer.get_vocab_size()} tokens, "
            f"fewer than vocab_size={vocab_size}"
        )
    tokenizer.save(str(out_dir / "tokenizer.json"))
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "added_tokens_decoder": added,
            "bos_token": None,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": IM_END,
            "model_max_length": MAX_POSITIONS,
            "pad_token": END_OF_TEXT,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    _write_json(
        out_dir / "special_tokens_map.json",
        {"eos_token": IM_END, "pad_token": END_OF_TEXT},
    )


def _model_config(vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "dtype": "bfloat16",
        "eos_token_id": EOS_ID,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": MAX_POSITIONS,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "pad_token_id": PAD_ID,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def _generation_config() -> dict[str, Any]:
    # Token ids only: sampling defaults here would silently become the engine's defaults.
    return {"eos_token_id": EOS_ID, "pad_token_id": PAD_ID}


def _weights(vocab_size: int, seed: int) -> Iterator[tuple[str, list[int], bytes]]:
    """Yield (name, shape, bf16 bytes) for every tensor, in the checkpoint's naming."""

    def rand(name: str, *shape: int) -> tuple[str, list[int], bytes]:
        return name, list(shape), _random_bf16(f"{seed}:{name}", shape[0] * shape[1])

    def ones(name: str, n: int) -> tuple[str, list[int], bytes]:
        return name, [n], _BF16_ONE * n

    yield rand("model.embed_tokens.weight", vocab_size, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        yield rand(p + "self_attn.q_proj.weight", HEADS * HEAD_DIM, HIDDEN)
        yield rand(p + "self_attn.k_proj.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        yield rand(p + "self_attn.v_proj.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        yield rand(p + "self_attn.o_proj.weight", HIDDEN, HEADS * HEAD_DIM)
        yield rand(p + "mlp.gate_proj.weight", INTERMEDIATE, HIDDEN)
        yield rand(p + "mlp.up_proj.weight", INTERMEDIATE, HIDDEN)
        yield rand(p + "mlp.down_proj.weight", HIDDEN, INTERMEDIATE)
        yield ones(p + "input_layernorm.weight", HIDDEN)
        yield ones(p + "post_attention_layernorm.weight", HIDDEN)
    yield ones("model.norm.weight", HIDDEN)
    yield rand("lm_head.weight", vocab_size, HIDDEN)


# Maps a random byte to the high byte of a bf16 value: bit 7 is the sign, the low 7 bits
# hold the top of the exponent. Two top-exponent values (60, 61) combined with the low
# exponent bit from the other byte give exponents 120..123, i.e. magnitudes in
# [2**-7, 2**-3): zero-mean values with an RMS near 0.055, so each 256-wide layer keeps
# activations near unit scale and the logits spread enough for clear greedy choices.
_HIGH_BYTE = bytes((b & 0x80) | (60 + (b & 1)) for b in range(256))


def _random_bf16(key: str, count: int) -> bytes:
    """`count` random bf16 values as little-endian bytes, derived only from `key`.

    Built with bytes operations that run in C, so 3 M values take milliseconds.
    """
    stream = hashlib.shake_256(f"draftgen-tiny-model:{key}".encode()).digest(2 * count)
    out = bytearray(2 * count)
    # Low byte: the low exponent bit and a 7-bit mantissa, uniformly random.
    out[0::2] = stream[:count]
    out[1::2] = stream[count:].translate(_HIGH_BYTE)
    return bytes(out)


def _write_safetensors(path: Path, tensors: Iterator[tuple[str, list[int], bytes]]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name, shape, data in tensors:
        header[name] = {
            "dtype": "BF16",
            "shape": shape,
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    # The format pads the header with spaces so the data starts 8-byte aligned.
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


ROUNDED_BUILD_VERSION = 1


def build_rounded_model(source_dir: Path, out_dir: Path, *, bits: int = 4) -> Path:
    """Copy the model in `source_dir` (built by `build_tiny_model`) into `out_dir` with
    every weight matrix (embedding, attention, MLP, LM head) rounded to `2**bits` levels.

    Per tensor and symmetric: the levels are `q * s` for the integers `q` in
    `[-2**(bits-1), 2**(bits-1) - 1]`, with `s` the tensor's largest magnitude over
    `2**(bits-1) - 1`; each value takes the nearest level, rounded back to bf16. The
    norms (all ones) and the tokenizer and config are copied as they are. Reused, like the
    model, when a stamp says the same source and bits built it.
    """
    if not 2 <= bits <= 8:
        raise ValueError("bits must be between 2 and 8")
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    source_stamp = _read_stamp(source_dir)
    if source_stamp is None:
        raise ValueError(f"{source_dir} holds no built tiny model")
    stamp = {"rounded_build_version": ROUNDED_BUILD_VERSION, "bits": bits,
             "source": source_stamp}
    if _read_stamp(out_dir) == stamp:
        return out_dir
    with _building(out_dir, stamp) as tmp:
        for item in source_dir.iterdir():
            if item.is_file() and item.name not in (STAMP_NAME, "model.safetensors"):
                shutil.copyfile(item, tmp / item.name)
        _write_safetensors(tmp / "model.safetensors",
                           _rounded(_read_safetensors(source_dir / "model.safetensors"), bits))
    return out_dir


def _read_safetensors(path: Path) -> Iterator[tuple[str, list[int], bytes]]:
    """(name, shape, bytes) of each bf16 tensor, in file order (as `_write_safetensors`)."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header: dict[str, Any] = json.loads(raw[8:8 + size])
    header.pop("__metadata__", None)
    start = 8 + size
    for name, meta in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        if meta["dtype"] != "BF16":
            raise ValueError(f"{path}: {name} is {meta['dtype']}, not BF16")
        a, b = meta["data_offsets"]
        yield name, list(meta["shape"]), raw[start + a:start + b]


def _bf16_to_float(bits16: int) -> float:
    value: float = struct.unpack("<f", struct.pack("<I", bits16 << 16))[0]
    return value


def _float_to_bf16(value: float) -> int:
    """Round-to-nearest-even from float32 (the values here are finite)."""
    u: int = struct.unpack("<I", struct.pack("<f", value))[0]
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def _rounded(tensors: Iterator[tuple[str, list[int], bytes]], bits: int
             ) -> Iterator[tuple[str, list[int], bytes]]:
    top = 2 ** (bits - 1) - 1
    for name, shape, data in tensors:
        if len(shape) != 2:
            yield name, shape, data  # the norms
            continue
        values = array("H", data)
        if sys.byteorder != "little":
            values.byteswap()
        # For finite floats the magnitude orders as the bit pattern without the sign.
        amax = _bf16_to_float(max(v & 0x7FFF for v in set(values)))
        scale = amax / top if amax else 1.0
        levels = {}
        for v in set(values):
            q = max(-top - 1, min(top, round(_bf16_to_float(v) / scale)))
            levels[v] = _float_to_bf16(q * scale)
        out = array("H", map(levels.__getitem__, values))
        if sys.byteorder != "little":
            out.byteswap()
        yield name, shape, out.tobytes()


@contextmanager
def _building(out_dir: Path, stamp: dict[str, Any]) -> Iterator[Path]:
    """A folder beside `out_dir` to build in, swapped in stamped when the block ends, so a
    crash never leaves a half-written model that a later run would serve."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        _publish(tmp, out_dir, stamp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, out_dir: Path, stamp: dict[str, Any]) -> None:
    """Move a finished build in place, stamped. Another process (a second test run, the
    demo) may have finished the same build meanwhile; its files are identical, so keep them
    rather than pull them from under it."""
    _write_json(tmp / STAMP_NAME, stamp)
    if _read_stamp(out_dir) == stamp:
        return
    shutil.rmtree(out_dir, ignore_errors=True)
    try:
        tmp.rename(out_dir)
    except OSError:
        if _read_stamp(out_dir) != stamp:
            raise
