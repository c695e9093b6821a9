"""sglang's hooks of a weight-update session on one engine rank — restore at begin
(``restore_weights_before_loading``), post-processing at end (``post_load_weights``, then
``process_weights_after_loading``), on the target and the draft model — run, or skipped once proven
to change nothing (:class:`UpdateHooks`).

The proof is made on the rank's own models, never assumed from the layout. One whole session, its
begin and its end, runs the hooks under a recorder of every tensor operation PyTorch dispatches
(a ``TorchDispatchMode``), and compares what the rank's modules hold before and after each: every
module's and quant method's attributes (by identity; containers by their items; numbers and
strings by value), every parameter's, buffer's and tensor attribute's identity, storage address,
shape, strides, dtype and device, and the digest (``control.weights_digest``) of the bytes of every
tensor but the parameters (the session's writes change those; a parameter's bytes change only by a
dispatched operation, or by a kernel launched outside the dispatcher with none beside it, which
sglang's hooks do not do). When the hooks dispatched no tensor operation but views and changed
nothing, they read no weight and wrote none, so what they do cannot depend on the weights' values;
and since they left the modules as they found them, every later session starts from the same state
and does the same thing: nothing. From then on they are skipped (``skipped`` in the rank's begin and
end answers). One operation or one change refutes the proof for the rank process's life: the hooks
then always run. One of sglang's loaders running (the broadcast path), in a session or not, starts
the proof over: the next session proves again.

The rank proves at its start (:meth:`UpdateHooks.prove_at_start`, before it reports ready), in an empty
session of its own, so that its first update's begin and end cost what later ones do. That is the
proof the first update's session would make: the module state it sees is the same (between the
rank's start and its first begin nothing changes a module's attributes or a tensor other than a
parameter: the verbs that could, sglang's loaders, start the proof over), and the only difference,
the parameters' bytes, is what the proof leaves out (hooks proven to dispatch nothing cannot read
them). Where the hooks do change things, the empty session is one any sender may open: restore, then
post-processing of the weights the rank holds.

On the CPU machine's and the H200's code paths the unquantized layouts prove out
(``UnquantizedLinearMethod`` repacks only for AMX CPUs; docs/replica.md, "Post-processing and
restore"); DeepSeek's ``post_load_weights`` (``w_kc``/``w_vc``) and FP8's scales do not, and keep
running. On a GPU rank skipping also removes sglang's per-module staging (``device_loading_context``):
~6 ms per hook at a Qwen3-4B TP2 rank on the H200.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

from ..control.weights_digest import digest_sums
from ..replica import sglang_env

logger = logging.getLogger(__name__)

#: what the proof's verdicts are called (the rank's answers, its log)
UNPROVEN, NO_OP, CHANGES = "unproven", "no-op", "changes"
#: dispatched operations that neither read nor write a tensor's values
_METADATA_OPS = frozenset({"aten.detach.default", "aten.alias.default", "aten.lift_fresh.default"})


def _operation_recorder() -> Any:
    """A ``TorchDispatchMode`` that records every operation it sees but views and metadata."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.operations: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            name = str(func)
            if not (getattr(func, "is_view", False) or name in _METADATA_OPS):
                self.operations.append(name)
            return func(*args, **(kwargs or {}))

    return Recorder()


class UpdateHooks:
    """The update-session hooks of one engine rank's models (``models``: the target, then the draft
    when the engine runs one; each runs under its own sglang context), with their proof."""

    def __init__(self, models: Sequence[torch.nn.Module], device: str, name: str = "engine", rank: int = 0,
                 *, prove: bool = True):
        self.models = list(models)
        self.device, self.name, self.rank = device, name, int(rank)
        self.prove = prove  # False: always run them (P2PW_RECEIVER_CONTROL=separate, the path measured against)
        self.verdict = UNPROVEN if prove else CHANGES
        self.why = "" if prove else "not proven: always run"
        self._begun_no_op = False  # this session's begin ran traced and changed nothing
        self.traced = 0  # traced runs of the hooks (begin or end): the proof's work, for the tests and the log

    # -- the session ---------------------------------------------------------------------------------
    def begin(self) -> bool:
        """sglang's begin on every model; True when skipped (proven no-op)."""
        import torch
        from sglang.srt.model_loader.loader import DefaultModelLoader

        def restore() -> None:
            for model in self.models:
                with sglang_env.activate(model):
                    DefaultModelLoader.restore_weights_before_loading(model, torch.device(self.device))
        if self.verdict == NO_OP:
            return True
        self._begun_no_op = self._run("restore_weights_before_loading", restore)
        return False

    def end(self, loader_ran: bool) -> bool:
        """sglang's end on every model: ``post_load_weights`` (unless a loader ran this session: it
        did that) and ``process_weights_after_loading``; True when skipped (proven no-op)."""
        import torch
        from sglang.srt.model_loader.loader import DefaultModelLoader, post_load_weights

        def post_process() -> None:
            for model in self.models:
                with sglang_env.activate(model):
                    if not loader_ran:
                        post_load_weights(model)
                    DefaultModelLoader.postprocess_weights(model, torch.device(self.device))
        if loader_ran:  # a loader may have changed what the proof saw: run, and prove again from the next session
            self.loader_ran()
            self._begun_no_op = False
            post_process()
            return False
        if self.verdict == NO_OP:
            return True
        ended_no_op = self._run("post_load_weights + process_weights_after_loading", post_process)
        if self._begun_no_op and ended_no_op and self.verdict == UNPROVEN:
            self.verdict = NO_OP
            self.why = "restore and post-processing ran no tensor operation and changed nothing in a whole session"
            logger.info("engine %s rank %d: sglang's update hooks are proven no-ops on this rank; skipped from now on",
                        self.name, self.rank)
        self._begun_no_op = False
        return False

    def prove_at_start(self) -> str:
        """The proof in an empty session (begin, then end; no write, no loader) while unproven: at
        the rank's start, so that no update pays for it. Answers the verdict."""
        if self.verdict == UNPROVEN:
            self.begin()
            self.end(loader_ran=False)
        return self.verdict

    def loader_ran(self) -> None:
        """One of sglang's loaders ran (in a session or not): what was proven may no longer hold."""
        if self.verdict == NO_OP:
            self.verdict, self.why = UNPROVEN, ""

    def state(self) -> dict:
        return {"verdict": self.verdict, "why": self.why, "traced": self.traced}

    # -- the proof -----------------------------------------------------------------------------------
    def _run(self, what: str, hooks: Callable[[], None]) -> bool:
        """Run ``hooks``; while unproven, traced: True when they proved a no-op this time."""
        if self.verdict != UNPROVEN:
            hooks()
            return False
        self.traced += 1
        before = self._state()
        recorder = _operation_recorder()
        with recorder:
            hooks()
        changed = _differences(before, self._state())
        if recorder.operations or changed:
            ops = sorted(set(recorder.operations))
            self.verdict = CHANGES
            self.why = (f"{what} ran {len(recorder.operations)} tensor operation(s) ({', '.join(ops[:5])})"
                        if ops else f"{what} changed {', '.join(changed[:5])}")
            logger.info("engine %s rank %d: sglang's update hooks run at every session: %s", self.name, self.rank,
                        self.why)
            return False
        return True

    def _state(self) -> dict[str, Any]:
        """What the models hold, per module: its attributes and its quant method's (identity;
        tensors by identity and layout), then the bytes of every tensor but the parameters."""
        state: dict[str, Any] = {}
        tensors: dict[int, torch.Tensor] = {}
        for index, model in enumerate(self.models):
            for mname, module in model.named_modules(remove_duplicate=False):
                quant = getattr(module, "quant_method", None)
                state[f"{index}:{mname}"] = (
                    tuple((k, _identity(v, tensors)) for k, v in vars(module).items()),
                    tuple((k, _identity(v, tensors)) for k, v in vars(quant).items()) if hasattr(quant, "__dict__")
                    else None)
        # bytes: of every tensor but the parameters, which the session's writes change (a parameter's
        # bytes are changed by a dispatched operation, which the recorder sees)
        real = [t for t in tensors.values() if not t.is_meta and t.numel() and not isinstance(t, torch.nn.Parameter)]
        if real:
            sums = torch.stack([digest_sums(t.detach().contiguous()).cpu() for t in real]).tolist()
            state.update({f"bytes of tensor {i} {tuple(t.shape)}": tuple(x) for i, (t, x) in enumerate(zip(real, sums))})
        return state


def _identity(value: Any, tensors: dict) -> Any:
    """A value as the proof compares it: tensors by identity and layout (their bytes are digested
    apart), containers by their items, numbers and strings by value, anything else by identity."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value  # an equal number assigned again is no change
    if isinstance(value, torch.Tensor):
        tensors.setdefault(id(value), value)
        return (id(value), None if value.is_meta else value.data_ptr(), tuple(value.shape), value.stride(),
                value.dtype, value.device)
    if isinstance(value, dict):
        return (id(value), tuple((k, _identity(v, tensors)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (id(value), tuple(_identity(v, tensors) for v in value))
    if isinstance(value, set):
        return (id(value), frozenset(map(id, value)))
    return id(value)


def _differences(before: dict, after: dict) -> list[str]:
    """What changed: a module (``<model>:<path>``) and its attribute, or a tensor's bytes."""
    out = []
    for key in sorted(before.keys() | after.keys()):
        was, now = before.get(key), after.get(key)
        if was == now:
            continue
        if isinstance(was, tuple) and isinstance(now, tuple) and len(was) == len(now) == 2 and key[:1].isdigit():
            attrs = {**dict(was[0]), **dict(now[0])}
            changed = [a for a in attrs if dict(was[0]).get(a) != dict(now[0]).get(a)]
            out.append(f"{key} ({', '.join(changed) or 'its quant method'})")
        else:
            out.append(key)
    return out
