"""The digest of a byte range, and an engine rank's digests of the parameters it holds: the wire
format of ``update(verify=True)`` (``POST /p2pw_weights_digest``). The sender digests the slot bytes
it wrote with the same function and compares, before the engines resume; here, below both sides, so
that neither imports the other.

The digest (:data:`ALGORITHM`): the bytes as little-endian 64-bit words ``w_i`` (the last one
zero-padded), laid out in rows of :data:`ROW_WORDS`, and three sums mod 2**64: ``S = sum(w_i)``,
``R = sum((row(i) + 1) * w_i)`` and ``C = sum((col(i) + 1) * w_i)``, as 48 hex digits. One flipped
byte changes ``S`` (by ``d * 2**(8k)``, ``0 < |d| < 256``, ``k < 8``: never 0 mod 2**64); ``R`` and
``C`` catch words that moved (to another row, or within one). Row and column sums are two
vectorized passes (about 3 GB/s on one CPU core), integer sums are exact and order-free, so a
sender's GPU and a rank's CPU agree. It detects corruption, not an adversary: it is not a
cryptographic hash (docs/security.md).

A parameter is digested as its bytes lie in memory from its address (:func:`in_memory_order`), the
bytes its rank publishes and a sender writes: for a contiguous tensor its logical order, for a dense
permutation of dimensions (sglang's Blackwell UE8M0 scales, int32 packed MN-major: strides ``(1, N)``)
the permuted order, never a logical-order copy (``docs/replica.md``, "Blackwell (sm100)").
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from ..errors import UnknownParameter

if TYPE_CHECKING:
    import torch

ALGORITHM = "sum64-rows-cols"
ROW_WORDS = 4096          # 32 KiB rows
_MASK = (1 << 64) - 1


def digest_sums(data: "torch.Tensor") -> "torch.Tensor":
    """``[S, R, C]`` (int64, on ``data``'s device, not synchronized) of a tensor's bytes (any dtype,
    contiguous)."""
    import torch

    raw = data.detach().reshape(-1).view(torch.uint8)
    n = raw.numel()
    full = n // 8 * 8
    if full and raw.storage_offset() % 8:
        raw = raw.clone()  # an int64 view needs 8-byte alignment
    words = raw[:full].view(torch.int64)
    if n > full:  # the tail, zero-padded to one word
        tail = torch.zeros(8, dtype=torch.uint8, device=raw.device)
        tail[: n - full] = raw[full:]
        words = torch.cat([words, tail.view(torch.int64)])
    m = words.numel() // ROW_WORDS * ROW_WORDS
    grid = words[:m].view(-1, ROW_WORDS)
    rest = words[m:]                    # the last, partial row
    rows = torch.cat([grid.sum(dim=1), rest.sum().reshape(1)])
    cols = grid.sum(dim=0)
    cols[: rest.numel()] += rest
    row_w = torch.arange(1, rows.numel() + 1, dtype=torch.int64, device=words.device)
    col_w = torch.arange(1, ROW_WORDS + 1, dtype=torch.int64, device=words.device)
    return torch.stack([rows.sum(), (rows * row_w).sum(), (cols * col_w).sum()])


def in_memory_order(t: "torch.Tensor") -> "torch.Tensor":
    """``t`` as its bytes lie in memory: itself when contiguous; for a dense permutation of its
    dimensions the permuted (contiguous) view, whose flat bytes are the ``numel x size`` bytes from
    its address; anything else (a view with holes) as it is (its logical order)."""
    if t.is_contiguous():
        return t
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -d))
    permuted = t.permute(order)
    return permuted if permuted.is_contiguous() else t


def digest_text(sums: Iterable[int]) -> str:
    """``[S, R, C]`` (as Python ints, signed or not) -> 48 hex digits."""
    return "".join(f"{int(x) & _MASK:016x}" for x in sums)


def digest(data: "torch.Tensor") -> str:
    """The digest of a tensor's bytes (synchronizes with its device)."""
    return digest_text(digest_sums(data).tolist())


def parameter_digests(model: "torch.nn.Module", names: Iterable[str], *, engine: str = "",
                      rank: int | None = None) -> dict[str, str]:
    """``{name: digest}`` of the bytes this rank holds for each named parameter (its published
    weights table's names). UnknownParameter names the rank and the parameter it does not hold."""
    import torch

    params = dict(model.named_parameters())
    names = list(names)
    missing = [n for n in names if n not in params]
    if missing:
        raise UnknownParameter(f"engine {engine} rank {rank} holds no parameter {missing[0]!r} to digest "
                               f"({len(missing)} unknown)", engine=engine or None, rank=rank, parameter=missing[0])
    if not names:
        return {}
    # as the bytes lie in memory (what the sender digested in its slot), one sync per rank
    sums = torch.stack([digest_sums(in_memory_order(params[n])) for n in names]).cpu().tolist()
    return {n: digest_text(pair) for n, pair in zip(names, sums)}
