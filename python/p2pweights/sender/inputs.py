"""What a trainer pushes, made into what the stager takes: before any check or staging, one push
goes through :meth:`TrainerInputs.prepare`:

1. a tied name (``lm_head.weight`` of a ``tie_word_embeddings`` model, which HF's ``state_dict()``
   still lists) is skipped, as sglang's ``load_weights`` skips it: the engine has one tensor for
   both, fed by the embedding;
2. an FSDP2 ``DTensor`` is gathered with ``full_tensor()`` (a collective over its mesh: every rank
   of the mesh must push the same names in the same order, as for any FSDP2 export); then a tensor
   with no dense bytes (meta, sparse, MKL-DNN, nested) is refused naming it (:func:`check_dense`);
3. with ``cast``, a floating-point tensor of another float dtype is cast to the checkpoint's dtype;
4. with ``check_finite`` (``P2PW_CHECK_FINITE=1``), NaN/Inf are refused naming the tensor, before
   anything of its parameter group is written.

FP8 engines: a weight the engine holds in float8_e4m3fn (with a block scale) is pushed in
BF16/FP16/FP32 and quantized on send (quantize.py), or pre-quantized; it is never cast (``cast``
would make FP8 of it without a scale). A weight that will be quantized is always checked for
NaN/Inf here, with or without ``check_finite``: no FP8 scale can be made of them, and a refusal at
push comes before anything is written or the engines are paused, not halfway through an update.

Also here: the rule for weight versions (:func:`check_version_order`).
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from ..errors import LayoutMismatch, NonFiniteTensor, UnsupportedTensor, VersionRefused
from .fp8 import TRAINER_DTYPES, quantized_pairs

_NUMBER = re.compile(r"[+-]?\d+(\.\d+)?")


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def _as_full_tensor(name: str, tensor: Any, where: str) -> Any:
    """A DTensor's full value (gathered over its mesh); anything else as it is."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without DTensor: nothing to gather
        return tensor
    if not isinstance(tensor, DTensor):
        return tensor
    try:
        return tensor.full_tensor()
    except Exception as e:  # noqa: BLE001 - any failure of the gather is the same refusal
        raise UnsupportedTensor(
            f"HF tensor {name!r}{where} is a DTensor (placements {tensor.placements}) that could not be "
            f"gathered with full_tensor(): {type(e).__name__}: {e}", parameter=name,
            hint="call it on every rank of the tensor's device mesh (same names, same order), or push "
                 "tensor.full_tensor() yourself") from e


def check_dense(name: str, tensor: Any, where: str = "") -> None:
    """Refuse, naming the tensor, what has no dense bytes to send: a meta tensor (no data), a sparse
    (COO, CSR, CSC, BSR, BSC), MKL-DNN or nested tensor. torch would fail on it later, inside the
    stager or a copy, after the engines were paused; here nothing is staged, written or paused yet."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        return  # the stager names what is not a tensor at all
    layout, device = tensor.layout, tensor.device
    if getattr(tensor, "is_nested", False):
        what, fix = "a nested tensor", "push each component as its own dense tensor"
    elif layout != torch.strided:
        what, fix = f"a {str(layout).removeprefix('torch.')} tensor", "push tensor.to_dense()"
    elif tensor.is_meta or device.type == "meta":
        what, fix = ("a meta tensor (shapes only, no data)",
                     "push the materialized weights (a model built on the meta device or with init_empty_weights "
                     "holds none)")
    else:
        return
    raise UnsupportedTensor(
        f"HF tensor {name!r}{where} is {what} (layout {str(layout).removeprefix('torch.')}, device {device}): only "
        f"dense (strided) tensors with data can be sent; nothing was staged or written and no engine was paused "
        f"for it", parameter=name, hint=fix)


class TrainerInputs:
    """The checks and conversions of one update's pushes.

    ``specs``: HF name -> expected spec (``.shape``, ``.dtype``), the union of the prepared
    replicas'; ``tied``: HF name -> the HF name whose tensor it is (from the model registry).
    """

    def __init__(self, specs: Mapping[str, Any], tied: Mapping[str, str], *, cast: bool = False,
                 check_finite: bool = False, where: str = ""):
        self._specs = specs
        self._tied = {n: t for n, t in tied.items() if n not in specs}  # only names the engine does not load
        self.cast = bool(cast)
        self.check_finite = bool(check_finite)
        self._where = f" ({where})" if where else ""
        self.skipped: list[str] = []  # tied names skipped in this update
        self._quantized = frozenset(quantized_pairs(specs))  # FP8 engines: weights quantized on send

    def prepare(self, name: str, tensor: Any) -> Any | None:
        """The tensor to stage for ``name``, or None when the engine loads nothing from it (a tied
        name). Raises UnsupportedTensor, LayoutMismatch (a tied name's shape), NonFiniteTensor."""
        if name in self._tied:
            self._check_tied(name, tensor)
            self.skipped.append(name)
            return None
        tensor = _as_full_tensor(name, tensor, self._where)
        check_dense(name, tensor, self._where)
        spec = self._specs.get(name)
        if name in self._quantized:
            if _dtype_name(tensor) in TRAINER_DTYPES:
                self._check_finite_to_quantize(name, tensor)
            elif self.check_finite:
                self._check_finite(name, tensor)
            return tensor
        if spec is not None and self.cast and _dtype_name(tensor) != spec.dtype:
            tensor = self._cast(name, tensor, spec.dtype)
        if self.check_finite:
            self._check_finite(name, tensor)
        return tensor

    def _check_tied(self, name: str, tensor: Any) -> None:
        source = self._specs.get(self._tied[name])
        if source is not None and tuple(tensor.shape) != tuple(source.shape):
            raise LayoutMismatch(
                f"HF tensor {name!r}{self._where} is tied to {self._tied[name]!r} (tie_word_embeddings), which "
                f"has shape {tuple(source.shape)}; got shape {tuple(tensor.shape)}", parameter=name,
                hint="is this the model the engines serve?")

    def _cast(self, name: str, tensor: Any, dtype: str) -> Any:
        import torch

        target = getattr(torch, dtype, None)
        if target is None or not tensor.is_floating_point() or not target.is_floating_point:
            return tensor  # not a float-to-float cast: the stager refuses the dtype, naming it
        return tensor.to(target)

    def _check_finite_to_quantize(self, name: str, tensor: Any) -> None:
        """NaN/Inf in a weight the sender will quantize. min and max propagate NaN and keep Inf: one
        aminmax pass (~10x faster than isfinite on CPU BF16) and one device synchronisation."""
        import torch

        if tensor.numel() == 0:
            return
        low, high = torch.aminmax(tensor)
        if bool(torch.isfinite(torch.stack((low, high))).all()):
            return
        self._check_finite(name, tensor, quantized=True)  # counts them and raises

    def _check_finite(self, name: str, tensor: Any, quantized: bool = False) -> None:
        import torch

        if not tensor.is_floating_point():
            return
        try:
            finite = torch.isfinite(tensor)
        except (RuntimeError, TypeError):  # float8 kinds without isfinite on this device
            finite = torch.isfinite(tensor.float())
        if bool(finite.all()):
            return
        bad = int((~finite).sum())
        if quantized:
            raise NonFiniteTensor(
                f"HF tensor {name!r}{self._where} holds {bad} NaN/Inf value(s) of {tensor.numel()}; the FP8 engine "
                f"needs it quantized, and no block scale can be made of NaN/Inf. Nothing of its parameter group "
                f"was written", parameter=name, hint="fix the training step")
        raise NonFiniteTensor(
            f"HF tensor {name!r}{self._where} holds {bad} NaN/Inf value(s) of {tensor.numel()}; nothing of its "
            f"parameter group was written", parameter=name,
            hint="fix the training step, or push without check_finite (P2PW_CHECK_FINITE) to write them anyway")


def _number(v: str) -> float | None:
    return float(v) if _NUMBER.fullmatch(v.strip()) else None


def check_version_order(new: str, own: str | None, engines: Mapping[str, str], *, force: bool = False) -> None:
    """Refuse a weight version that does not come after this sender's last one (``own``) and each
    engine's current one (``engines``: name -> version): numerically when both read as numbers,
    else only an equal one. An empty version is always refused; ``force`` allows any other."""
    if not str(new).strip():
        raise VersionRefused("the weight version is empty; pass a step number or a label",
                             hint="sender.update(version=step)")
    if force:
        return
    older = [("this sender's last update", own, None)] + [(f"engine {n}", v, n) for n, v in engines.items()]
    for who, old, engine in older:
        if old is None:
            continue
        n_new, n_old = _number(new), _number(str(old))
        if (n_new is not None and n_old is not None and n_new <= n_old) or str(new) == str(old):
            raise VersionRefused(
                f"weight version {new!r} does not come after {who}'s {str(old)!r} (versions must increase: "
                f"numerically when both are numbers, else differ)", engine=engine,
                hint="pass the next step, or update(..., force=True) to set it anyway")
