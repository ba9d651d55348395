"""Stand-ins for the trainer's GPU libraries in Prime-RL's orchestrator and env-server processes (see README.md).

Python imports ``sitecustomize`` at start-up from the first folder on ``sys.path`` that has one: with this folder first
on ``PYTHONPATH``, the modules named in ``MODULES`` (and their parent packages) are served by a finder placed after
the real ones, so an installed package always wins and a stand-in only fills a gap.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

# Every module of these libraries that Prime-RL imports at import time on the orchestrator's and the env-server's
# path, and why it is not installed: torchtitan (Prime-RL pins a git revision; PyPI's release lacks
# expert_parallel), ring_flash_attn (needs flash_attn, a CUDA build), torchao's mx_linear (Prime-RL runs its own
# torchao build; PyPI's release, installed, lacks this module), vllm (only the NCCL weight transport's types: the
# filesystem transport is the one used).
MODULES = [
    "torchtitan.distributed.expert_parallel",
    "torchtitan.distributed.utils",
    "torchtitan.experiments.kernels.moe.indices",
    "ring_flash_attn",
    "torchao.prototype.mx_formats.mx_linear",
    "vllm.distributed.utils",
    "vllm.distributed.device_communicators.pynccl",
]
PACKAGES = {m.rsplit(".", i)[0] for m in MODULES for i in range(1, m.count(".") + 1)}


class _Unused(type):
    """A stand-in name: a class (the trainer subclasses some at import time) whose attributes are stand-ins too and
    which raises, naming itself, when it is called: nothing on the orchestrator's path calls one."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return unused(f"{cls.__module__}.{cls.__qualname__}", name)

    def __call__(cls, *args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError(f"{cls.__module__}.{cls.__qualname__} is a stand-in (tito's scripts/prime_run/standins): "
                           "the trainer's GPU code, not on the orchestrator's path")


def unused(module: str, name: str) -> Any:
    return _Unused(name, (), {"__module__": module, "__qualname__": name})


F = TypeVar("F", bound=Callable[..., object])


def _expert_parallel(fn: F) -> F:
    """torchtitan's decorator, applied at import time to the trainer's MoE functions: the function unchanged."""
    return fn


# Names that are used at import time, not only called.
DEFINED: dict[str, dict[str, object]] = {
    "torchtitan.distributed.expert_parallel": {"expert_parallel": _expert_parallel},
}


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name, "A stand-in: see tito's scripts/prime_run/standins/README.md.")
        module.__dict__.update(DEFINED.get(spec.name, {}))

        def __getattr__(name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return unused(spec.name, name)

        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in PACKAGES and fullname not in MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=fullname in PACKAGES)


sys.meta_path.append(_Finder())
