"""What is different while sglang's modules are imported by a replica (``sglang_env.prepare`` and
each architecture's model module), and only in the importing thread.

Importing sglang is most of a cold connect (benchmarks/profile_import.py). Two of its costs serve
inference only, never the model built on meta nor its loaders, and are cut here:

- ``torch.compile`` runs at import time as a decorator on dozens of sglang functions (rotary
  embeddings, samplers, MoE helpers); resolving its backend imports ``torch._inductor`` and
  ``torch._dynamo``'s debugging tools (≈1.3 s, ≈540 modules, on the CPU machine). Here the
  decorated function is wrapped instead, and the real ``torch.compile`` runs at its first call,
  with the same arguments: what a caller gets when it calls it is unchanged (torch.compile
  compiles at the first call anyway).
- ``IPython`` is imported by ``sglang.utils`` for one notebook helper (``print_highlight`` in CI);
  its import pulls in jedi and prompt_toolkit (≈0.25 s, ≈430 modules, on the CPU machine; the GPU
  bundle carries a stub IPython already). While sglang imports, an ``IPython`` not imported yet is
  a stub; afterwards the stub leaves ``sys.modules`` so the process's own ``import IPython`` gets
  the real one (``sglang.utils`` keeps the stub's ``HTML``/``display``).

With ``P2PW_SGLANG_IMPORT_AS_CPU=1`` sglang also sees ``torch.cuda.is_available() == False``.

Every change applies to the importing thread only: a trainer's other threads (and the early-slots
thread beside a connect, sender/early_slots.py) see torch as it is. What the replica builds and
loads is unchanged: no module whose code runs while building or loading is replaced.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
import threading
import types
from typing import Any, Callable, Iterator

_STUBBED = ("IPython",)  # top-level packages stubbed while sglang imports (when not imported already)


class AnyAttribute:
    """What a stub module hands out: callable, subclassable, any attribute."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return AnyAttribute(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return AnyAttribute(f"{self._name}()")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of ``packages`` (and their submodules) get an empty package whose attributes are
    :class:`AnyAttribute`. ``thread``: only imports made by that thread (None: every thread)."""

    def __init__(self, packages: tuple[str, ...], thread: int | None = None):
        self.packages = packages
        self.thread = thread

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if self.thread is not None and threading.get_ident() != self.thread:
            return None
        top = fullname.split(".", 1)[0]
        if top not in self.packages:
            return None
        loaded = sys.modules.get(top)
        if loaded is not None and not vars(loaded).get("__p2pw_stub__", False):
            return None  # another thread imported the real package meanwhile: its submodules are real too
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []  # a package, so submodule imports come back here
        module.__version__ = "0.0.0+p2pweights.stub"
        module.__p2pw_stub__ = True

        def __getattr__(attr: str, _name: str = spec.name) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return AnyAttribute(f"{_name}.{attr}")

        module.__getattr__ = __getattr__  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def deferred_compile(real: Callable[..., Any]) -> Callable[..., Any]:
    """A ``torch.compile`` that wraps a function and calls ``real(fn, **options)`` at its first call.
    A module (or anything not a plain function) goes to ``real`` at once."""

    def compile(model: Any = None, **options: Any) -> Any:
        if model is None:  # @torch.compile(dynamic=True, ...)
            return lambda fn: compile(fn, **options)
        if not isinstance(model, (types.FunctionType, types.MethodType)):
            return real(model, **options)
        compiled: list[Any] = []

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kwargs: Any) -> Any:
            if not compiled:
                compiled.append(real(model, **options))
            return compiled[0](*args, **kwargs)

        first_call_compiles.__p2pw_deferred_compile__ = options  # type: ignore[attr-defined]
        return first_call_compiles

    return compile


class _ThreadPatch:
    """``owner.attr`` answers ``replacement`` in the threads that entered it, the original elsewhere."""

    def __init__(self, owner: Any, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]):
        self.owner, self.attr = owner, attr
        self.original = getattr(owner, attr)
        self.replacement = make(self.original)
        self.threads: dict[int, int] = {}  # thread id -> nesting depth

        def dispatch(*args: Any, **kwargs: Any) -> Any:
            fn = self.replacement if threading.get_ident() in self.threads else self.original
            return fn(*args, **kwargs)

        functools.update_wrapper(dispatch, self.original)
        self.dispatch = dispatch


_patches: dict[tuple[int, str], _ThreadPatch] = {}
_patch_lock = threading.Lock()


@contextlib.contextmanager
def _patched_in_this_thread(owner: Any, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    key, me = (id(owner), attr), threading.get_ident()
    with _patch_lock:
        patch = _patches.get(key)
        if patch is None:
            patch = _patches[key] = _ThreadPatch(owner, attr, make)
            setattr(owner, attr, patch.dispatch)
        patch.threads[me] = patch.threads.get(me, 0) + 1
    try:
        yield
    finally:
        with _patch_lock:
            patch.threads[me] -= 1
            if not patch.threads[me]:
                del patch.threads[me]
            if not patch.threads:  # the last importing thread is done: torch as it was
                setattr(owner, attr, patch.original)
                del _patches[key]


@contextlib.contextmanager
def _stubs_in_this_thread() -> Iterator[None]:
    missing = tuple(p for p in _STUBBED if p not in sys.modules)
    if not missing:
        yield
        return
    finder = StubFinder(missing, thread=threading.get_ident())
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        stubs = [n for n, m in list(sys.modules.items())  # vars(): a lazy module's getattr imports
                 if n.split(".", 1)[0] in missing and vars(m).get("__p2pw_stub__", False)]
        for name in stubs:
            del sys.modules[name]  # the modules that imported it keep their names; a later import is real


@contextlib.contextmanager
def sglang_imports(as_cpu: bool) -> Iterator[None]:
    """Import sglang modules inside this (this thread only; re-entrant; see the module's docstring)."""
    import torch

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched_in_this_thread(torch, "compile", deferred_compile))
        stack.enter_context(_stubs_in_this_thread())
        if as_cpu:
            stack.enter_context(_patched_in_this_thread(torch.cuda, "is_available", lambda real: lambda: False))
        yield
