"""vLLM's own refusals of a model, read as refusals: one line naming vLLM's reason and that the limit
is vLLM's on the platform the replica builds for (Hopper, ``vllm_env``), not p2pweights'.

MLA prefill backend (vLLM 0.33): every MLA attention layer asks
``vllm.v1.attention.backends.mla.prefill.get_mla_prefill_backend`` for a prefill backend; on a GPU
platform ``Platform.get_mla_prefill_backend_cls`` (``vllm/platforms/interface.py``) tries, by
compute capability, FLASH_ATTN only on Hopper (sm90) and older, and FLASH_ATTN, TRTLLM_RAGGED,
FLASHINFER, TOKENSPEED_MLA on Blackwell (sm100); each takes only some (qk_nope_head_dim,
qk_rope_head_dim, v_head_dim) triples, and a model whose triple none takes is a ``ValueError: No
valid MLA prefill backend found with ...``. Naming a backend (``--attention-config
'{"mla_prefill_backend": ...}'``) is validated against the same triples. Nothing imports vLLM here.
"""
from __future__ import annotations

import re
from typing import Any

from ..errors import UnsupportedLayout
from .vllm_layout import VllmLayout

#: (qk_nope_head_dim, qk_rope_head_dim, v_head_dim) vLLM 0.33's FLASH_ATTN MLA prefill backend takes
#: (``FlashAttnPrefillBackend.supports_mla_dimensions``), the only one vLLM tries on Hopper
FLASH_ATTN_MLA_DIMS = ((128, 64, 128), (192, 64, 256), (64, 64, 128), (256, 0, 256))


def is_mla_prefill_refusal(error: BaseException) -> bool:
    """vLLM found no MLA prefill backend for the model: auto-selected (``No valid MLA prefill backend
    found with ...``) or named (``Selected MLA prefill backend X is not valid ...``)."""
    text = str(error)
    return isinstance(error, ValueError) and (text.startswith("No valid MLA prefill backend") or (
        text.startswith("Selected MLA prefill backend") and "is not valid" in text))


def _first_sentence(text: str) -> str:
    return re.split(r"(?<=[)\w])\. ", text.strip(), maxsplit=1)[0].rstrip(".")


def _dims(model_config: Any) -> tuple[int, int, int]:
    """The head-dim triple vLLM's selector reads (``hf_text_config``, a missing one read as 0)."""
    hf = getattr(model_config, "hf_text_config", model_config)
    get = (lambda k: hf.get(k, 0)) if isinstance(hf, dict) else (lambda k: getattr(hf, k, 0))
    return int(get("qk_nope_head_dim") or 0), int(get("qk_rope_head_dim") or 0), int(get("v_head_dim") or 0)


def mla_prefill_refusal(error: BaseException, model_config: Any, layout: VllmLayout) -> UnsupportedLayout:
    """The one-line refusal for vLLM's MLA prefill backend error (``model_config``: vLLM's
    ModelConfig, or the model's config.json as a dict)."""
    text = str(error)
    tried = re.findall(r"(\w+): \[", text.partition("Reasons:")[2]) or \
        re.findall(r"^Selected MLA prefill backend (\w+)", text) or ["FLASH_ATTN"]
    takes = ", ".join(f"({a}, {b}, {c})" for a, b, c in FLASH_ATTN_MLA_DIMS)
    return UnsupportedLayout(
        f"vLLM engine {layout.describe()}: vLLM 0.33 itself refuses this model: {_first_sentence(text)} "
        f"(its MLA head dims (qk_nope, qk_rope, v) = {_dims(model_config)} are taken by none of the MLA prefill "
        f"backends vLLM tried: {', '.join(tried)}); vLLM picks that backend from the head dims and the GPU "
        f"(Platform.get_mla_prefill_backend_cls): on Hopper (sm90), the platform the replica builds for, only "
        f"FLASH_ATTN, which takes {takes}; naming a backend (--attention-config mla_prefill_backend) is checked "
        f"against the same dims, so no engine flag changes it: this is vLLM's limit on this platform, not "
        f"p2pweights'")
