"""Boot an SGLang release's own Python modules on a CPU-only machine, as a test oracle.

Only `oracle_worker.py` imports this, inside its own process: the stubs, the bare `sglang`
package and the `sys.path` entries are process-wide, so one process holds one release and
the pytest process never holds any.

`boot(DIR)` (DIR made by `pip install --no-deps --target DIR sglang==X`, see
scripts/install-oracles.sh):
  * puts DIR (and extra folders, e.g. the one holding `gguf`) first on sys.path;
  * registers `sglang` as a bare package, so sglang/__init__.py (the frontend language,
    which pulls in triton and IPython) never runs;
  * serves stub modules for what cannot be installed here or is never reached: triton (no
    CPU wheel torch-cpu accepts), IPython (notebook helpers in sglang/utils.py), torchvision
    (its PyPI wheel's C ops fail on torch-cpu), sgl_kernel (CUDA kernels), soundfile (audio).

The stubs hide from `importlib.util.find_spec`, and torch's and transformers' cached
"is it installed" probes are answered before they go in, so those libraries still see the
packages as absent and never take a stub for the real thing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Iterable
from typing import Any

DEFAULT_STUBS = ("triton", "IPython", "torchvision", "sgl_kernel", "soundfile")
# Calls that must fail, so the caller takes its no-triton path (0.5.9's
# layers/attention/fla/utils.py then settles on "cpu").
_RAISING_CALLS = ("get_current_target", "get_active_torch_device")

_CLASSES: dict[str, type] = {}


def _stub_class(name: str) -> type:
    def _init(self: object, *args: Any, **kwargs: Any) -> None:
        pass

    def _getattr(self: object, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Obj(f"{name}.{attr}")

    return type(name.rsplit(".", 1)[-1], (), {"__init__": _init, "__getattr__": _getattr})


def _child(name: str) -> Any:
    # CapitalisedNames become real classes, so isinstance() and subclassing work.
    if name.rsplit(".", 1)[-1][:1].isupper():
        return _CLASSES.setdefault(name, _stub_class(name))
    return _Obj(name)


class _Obj:
    """Any attribute of a stub module: callable, subscriptable, iterable (empty), falsy."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._name.endswith(_RAISING_CALLS):
            raise RuntimeError("stub: no triton driver")
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # a bare decorator such as @triton.jit
        return _Obj(f"{self._name}()")

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _child(f"{self._name}.{attr}")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)

    def __getitem__(self, key: Any) -> Any:
        return self

    def __or__(self, other: Any) -> Any:
        return self

    __ror__ = __or__

    def __iter__(self) -> Any:
        return iter(())

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<stub {self._name}>"


class _StubModule(types.ModuleType):
    __path__: list[str] = []  # noqa: RUF012 (a package: submodule imports resolve to stubs)
    __version__ = "0.0.0"

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _child(f"{self.__name__}.{attr}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] not in self.names:
            return None
        frame = sys._getframe(1)
        for _ in range(4):  # an importlib.util.find_spec() probe: "not installed"
            if frame is None:
                break
            code = frame.f_code
            if code.co_name == "find_spec" and code.co_filename.endswith("importlib/util.py"):
                return None
            frame = frame.f_back
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _freeze_probes() -> None:
    """Ask torch and transformers now, while the packages are absent; both cache it."""
    try:
        import torch.utils._triton as torch_triton

        torch_triton.has_triton_package()
        torch_triton.has_triton()
    except Exception:  # torch may lack the probe; then it never asks
        pass
    try:
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
    except Exception:  # as above
        pass


def boot(sglang_dir: str, *, extra_paths: Iterable[str] = (),
         stubs: Iterable[str] = DEFAULT_STUBS) -> None:
    for p in (*extra_paths, sglang_dir):
        if p not in sys.path:
            sys.path.insert(0, p)
    _freeze_probes()
    sys.meta_path.insert(0, _StubFinder(stubs))
    if "sglang" not in sys.modules:
        pkg = types.ModuleType("sglang")
        pkg.__path__ = [os.path.join(sglang_dir, "sglang")]
        spec = importlib.util.spec_from_loader("sglang", loader=None, is_package=True)
        assert spec is not None
        spec.submodule_search_locations = pkg.__path__
        pkg.__spec__ = spec
        sys.modules["sglang"] = pkg
