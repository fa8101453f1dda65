"""What the engines share: the argv's common flags, GET helpers, reading a model's folder,
what an `auto` KV dtype means, extra-args flag surgery, and lenient number parsing."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from draftgen.engines.info import ServerInfoError

if TYPE_CHECKING:
    from draftgen.engines.spec import LaunchSpec

_INFO_TIMEOUT_S = 30.0


def common_flags(profile: LaunchSpec, port: int, *, model_flag: str) -> list[str]:
    args = [model_flag, profile.model_path]
    if profile.served_name:
        args += ["--served-model-name", profile.served_name]
    return [*args, "--host", profile.host, "--port", str(port)]


def limit_flags(profile: LaunchSpec, *, kv_dtype: str, running_flag: str,
                context_flag: str) -> list[str]:
    """The flags every engine takes from the same profile fields, in its own spelling."""
    args = ["--kv-cache-dtype", kv_dtype]
    if profile.model_dtype:
        args += ["--dtype", profile.model_dtype]
    if profile.reasoning_parser:
        args += ["--reasoning-parser", profile.reasoning_parser]
    if profile.max_running_requests is not None:
        args += [running_flag, str(profile.max_running_requests)]
    if profile.context_length is not None:
        args += [context_flag, str(profile.context_length)]
    return args


async def get_json(session: aiohttp.ClientSession, url: str) -> Any | None:
    """The JSON body at `url`, or None for 404/405 (the endpoint does not exist here)."""
    text = await get_text(session, url)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


async def get_text(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=_INFO_TIMEOUT_S)) as r:
            if r.status in (404, 405):
                return None
            if r.status >= 400:
                raise ServerInfoError(f"GET {url}: HTTP {r.status}")
            return await r.text()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise ServerInfoError(f"GET {url}: {type(e).__name__}: {e}") from None


def read_model_config(model_path: str | None) -> dict[str, Any] | None:
    """config.json of a model on this machine's disk, or None (a hub id, another host)."""
    if not model_path:
        return None
    try:
        raw = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def checkpoint_kv_scheme(model_path: str | None) -> str | None:
    """The quantized KV scheme a checkpoint declares, which `auto` may silently adopt."""
    config = read_model_config(model_path) or {}
    quant = config.get("quantization_config")
    if isinstance(quant, dict):
        for key in ("kv_cache_scheme", "kv_cache_quant_algo", "kv_cache_dtype"):
            if quant.get(key):
                return f"quantization_config.{key}={json.dumps(quant[key], sort_keys=True)}"
    if model_path:
        # ModelOpt checkpoints keep it in hf_quant_config.json.
        try:
            hf_quant = json.loads(
                (Path(model_path).expanduser() / "hf_quant_config.json").read_text()
            )
        except (OSError, ValueError):
            hf_quant = None
        algo = (hf_quant or {}).get("quantization", {}).get("kv_cache_quant_algo")
        if algo:
            return f"hf_quant_config.json kv_cache_quant_algo={algo}"
    return None


def resolve_auto_kv_dtype(
    model_path: str | None, model_dtype: str | None
) -> tuple[str | None, str]:
    """What `auto` means for this model: (dtype or None, how we know).

    `auto` takes the model's dtype unless the checkpoint declares a quantized KV scheme;
    both are read from the model folder when it is on this machine.
    """
    scheme = checkpoint_kv_scheme(model_path)
    if scheme:
        return "fp8", f"auto, and the checkpoint declares a quantized KV cache ({scheme})"
    if model_dtype and model_dtype != "auto":
        return model_dtype, f"auto → the model dtype {model_dtype} (server setting)"
    config = read_model_config(model_path)
    if config is not None:
        dtype = config.get("torch_dtype") or config.get("dtype")
        if isinstance(dtype, str):
            return dtype, f"auto → the model dtype {dtype} (config.json of {model_path})"
    return None, "auto, and the model dtype could not be read (model not on this machine)"


def model_max_len(models: Any) -> int | None:
    """`max_model_len` of the first model in a /v1/models answer."""
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        return as_int(data[0].get("max_model_len"))
    return None


def as_int(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            f = float(v)
        except ValueError:
            return None
        return int(f) if f.is_integer() else None
    return None


def as_float(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def as_str(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value `args` give `flag` (`--f V` or `--f=V`; the last one wins), or None."""
    found = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith(flag + "="):
            found = a.split("=", 1)[1]
    return found


def drop_flag(args: Sequence[str], flag: str, *, valued: bool) -> list[str]:
    """`args` without `flag` (and its value, for a flag that takes one)."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = valued
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out


def set_flag(args: Sequence[str], flag: str, value: str) -> list[str]:
    return [*drop_flag(args, flag, valued=True), flag, value]
