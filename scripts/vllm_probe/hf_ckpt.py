"""A random checkpoint in on-disk HF naming (per-expert tensors; FP8 128x128 blocks when the
config says so), from transformers' in-memory model (which fuses experts in v5)."""
import json, os, re
import torch


def _blockwise_fp8(w, block=(128, 128)):
    out_f, in_f = w.shape
    bo, bi = block
    nbo, nbi = -(-out_f // bo), -(-in_f // bi)
    pad = torch.zeros(nbo * bo, nbi * bi, dtype=torch.float32)
    pad[:out_f, :in_f] = w.float()
    blocks = pad.view(nbo, bo, nbi, bi)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / 448.0
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(nbo * bo, nbi * bi)[:out_f, :in_f].contiguous(), scale.to(torch.float32)


def hf_checkpoint(cfg_dir, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = json.load(open(os.path.join(cfg_dir, "config.json")))
    hf_cfg = AutoConfig.from_pretrained(cfg_dir)
    if hasattr(hf_cfg, "quantization_config"):
        del hf_cfg.quantization_config
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)
    out = {}
    for k, v in hf.state_dict().items():
        v = v.detach().clone()
        m = re.match(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", k)
        if m:
            for e in range(v.shape[0]):
                if m.group(2) == "gate_up_proj":
                    g, u = v[e].chunk(2, dim=0)
                    out[f"{m.group(1)}.{e}.gate_proj.weight"] = g.contiguous()
                    out[f"{m.group(1)}.{e}.up_proj.weight"] = u.contiguous()
                else:
                    out[f"{m.group(1)}.{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[k] = v
    if cfg.get("tie_word_embeddings"):
        out.pop("lm_head.weight", None)
    q = cfg.get("quantization_config")
    if q and q.get("quant_method") == "fp8":
        block = tuple(q["weight_block_size"])
        for k in list(out):
            if k.endswith("_proj.weight") or k.endswith("kv_a_proj_with_mqa.weight"):
                w, s = _blockwise_fp8(out[k], block)
                out[k] = w
                out[k[: -len("weight")] + "weight_scale_inv"] = s
    return out
