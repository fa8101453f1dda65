"""Build the tiny random-weight Llama model that the local vLLM engine serves.

No model can be downloaded here, so tests, the demo and benchmarks use a model we make: a
LlamaForCausalLM (hidden 256, 2 layers, 4 heads, 2 KV heads, ~3.3 M parameters, bf16) with a
byte-level BPE tokenizer trained on `corpus.txt`, a ChatML-style template and an end token.
Its text is gibberish; what matters is that it is a real model a real engine runs.

The weights are written straight to safetensors from a SHAKE-256 stream, using only the
standard library: the build takes a fraction of a second, needs neither torch nor numpy,
and is byte-identical on every machine and with every library version (the tokenizer
depends on the `tokenizers` version only).

A 4-bit-rounded copy of it (the lossy model of the tests) is `rounded.py`'s.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from draftgen.local.build import building, read_stamp, write_json, write_safetensors

# Bump when the output of a build changes for the same parameters, so stale caches rebuild.
BUILD_VERSION = 1
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
    if read_stamp(out_dir) == stamp:
        return out_dir
    with building(out_dir, stamp) as tmp:
        _write_tokenizer(tmp, vocab_size)
        write_json(tmp / "config.json", _model_config(vocab_size))
        write_json(tmp / "generation_config.json", _generation_config())
        write_safetensors(tmp / "model.safetensors", _weights(vocab_size, seed))
    return out_dir


def _stamp(vocab_size: int, seed: int) -> dict[str, Any]:
    corpus_sha = hashlib.sha256(CORPUS_PATH.read_bytes()).hexdigest()
    return {
        "build_version": BUILD_VERSION,
        "vocab_size": vocab_size,
        "seed": seed,
        "corpus_sha256": corpus_sha,
    }


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
    write_json(
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
    write_json(
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


