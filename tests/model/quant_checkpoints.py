"""Tiny quantized checkpoints for the quantization tests, and their fp32 references.

Each writer takes a tiny random Llama (transformers, fp32), quantizes its seven projections per
layer into one format's tensors, and saves them with the format's ``quantization_config``. The
packers here are written plainly and independently of pagedllm's (compressed-tensors checkpoints
come from the library's own compressors), and each writer returns the dequantized weights: the
reference model is the transformers model holding exactly those weights, in fp32; for W8A8
formats, forward pre-hooks fake-quantize each projection's input the way the format prescribes.
"""
from __future__ import annotations

import json
import os

import torch

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def tiny_llama(out_dir: str, seed: int = 0, **overrides):
    """A random Llama whose every projection's K is a multiple of 128 (hidden 128, intermediate
    256, 4 heads of 32: q 128, k/v 64)."""
    import transformers

    cfg = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.05,
               bos_token_id=1, eos_token_id=2, dtype="float32", tie_word_embeddings=False, rope_theta=10000.0)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**cfg), dtype=torch.float32)
    return model.eval()


def _projection_names(model):
    for i in range(model.config.num_hidden_layers):
        for proj in PROJECTIONS:
            yield f"model.layers.{i}.{proj}"


def _save(model, out_dir: str, tensors: dict, quantization_config: dict | None) -> None:
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    quantized = {k.rsplit(".", 1)[0] for k in tensors}  # their dense weights are replaced
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if k.rsplit(".", 1)[0] not in quantized or not k.endswith(".weight")}
    state.update({k: v.contiguous() for k, v in tensors.items()})
    save_file(state, os.path.join(out_dir, "model.safetensors"))
    config = model.config.to_dict()
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits -> int32 (two's complement)."""
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


# ---- int4 groups -----------------------------------------------------------------------------

def quantize_int4(w: torch.Tensor, group: int, symmetric: bool):
    """w [N, K] -> (q [N, K] 0..15, scales [N, K / G], zeros [N, K / G] 0..15), dequant (q - z) s."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    if symmetric:
        scale = g.abs().amax(-1) / 7.0
        zero = torch.full_like(scale, 8, dtype=torch.int64)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = (hi - lo) / 15.0
        zero = torch.round(-lo / scale).clamp(0, 15).long()
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15).long()
    return q.view(n, k), scale, zero


def dequant_int4(q, scale, zero, group: int) -> torch.Tensor:
    n, k = q.shape
    return ((q.view(n, k // group, group) - zero[..., None]).float() * scale[..., None].float()).view(n, k)


def _pack_gptq_rows(vals: torch.Tensor) -> torch.Tensor:
    """[8 R, C] -> [R, C]: value 8 r + i in bits 4 i."""
    r8, c = vals.shape
    words = torch.zeros(r8 // 8, c, dtype=torch.int64)
    for i in range(8):
        words |= vals[i::8].long() << (4 * i)
    return to_int32(words)


def _pack_cols(vals: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[R, 8 C] -> [R, C]: nibble i holds column 8 c + order[i]."""
    r, c8 = vals.shape
    words = torch.zeros(r, c8 // 8, dtype=torch.int64)
    for i in range(8):
        words |= vals[:, order[i]::8].long() << (4 * i)
    return to_int32(words)


def write_gptq(out_dir: str, group: int = 32, symmetric: bool = False, checkpoint_format: str = "gptq", **kw):
    model = tiny_llama(out_dir, **kw)
    tensors, sd = {}, model.state_dict()
    offset = 1 if checkpoint_format == "gptq" else 0
    for name in _projection_names(model):
        q, s, z = quantize_int4(sd[name + ".weight"], group, symmetric)
        tensors[name + ".qweight"] = _pack_gptq_rows(q.t())  # [K / 8, N]
        tensors[name + ".qzeros"] = _pack_cols((z.t() - offset) & 0xF)  # [K / G, N / 8], stored minus one
        tensors[name + ".scales"] = s.t().half()
        tensors[name + ".g_idx"] = torch.arange(q.shape[1], dtype=torch.int32) // group
        sd[name + ".weight"].copy_(dequant_int4(q, s.half(), z, group))
    _save(model, out_dir, tensors, {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                                    "sym": symmetric, "checkpoint_format": checkpoint_format})
    return model


def write_awq(out_dir: str, group: int = 32, **kw):
    model = tiny_llama(out_dir, **kw)
    tensors, sd = {}, model.state_dict()
    for name in _projection_names(model):
        q, s, z = quantize_int4(sd[name + ".weight"], group, symmetric=False)
        tensors[name + ".qweight"] = _pack_cols(q.t(), AWQ_ORDER)  # [K, N / 8]
        tensors[name + ".qzeros"] = _pack_cols(z.t(), AWQ_ORDER)  # [K / G, N / 8]
        tensors[name + ".scales"] = s.t().half()
        sd[name + ".weight"].copy_(dequant_int4(q, s.half(), z, group))
    _save(model, out_dir, tensors, {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                    "version": "gemm"})
    return model


def _ct_int4_scheme(group: int, symmetric: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group)
    return QuantizationScheme(targets=["Linear"], weights=args)


def ct_int4_tensors(w: torch.Tensor, group: int, symmetric: bool) -> tuple[dict, torch.Tensor]:
    """One weight [N, K] packed by compressed-tensors' own qparams and compressor (its tensors by
    name: weight_packed, weight_scale, ...), and the weight its decompressor gives back."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = _ct_int4_scheme(group, symmetric)
    g = w.view(w.shape[0], -1, group)
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights)
    state = {"weight": w, "weight_scale": scale}
    if not symmetric:
        state["weight_zero_point"] = zp
    out = PackedQuantizationCompressor.compress(state, scheme)
    back = PackedQuantizationCompressor.decompress(dict(out), scheme)
    return out, back["weight"].float()


def ct_int4_config(group: int, symmetric: bool) -> dict:
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig(config_groups={"group_0": _ct_int4_scheme(group, symmetric)}, format="pack-quantized",
                            quantization_status="compressed", ignore=["lm_head"])
    return qc.model_dump(mode="json", exclude_none=True)


def write_ct_int4(out_dir: str, group: int = 32, symmetric: bool = True, **kw):
    """pack-quantized W4A16 by compressed-tensors' own qparams and compressor; the reference
    weights by its decompressor."""
    model = tiny_llama(out_dir, **kw)
    tensors, sd = {}, model.state_dict()
    for name in _projection_names(model):
        out, back = ct_int4_tensors(sd[name + ".weight"], group, symmetric)
        tensors.update({f"{name}.{k}": v for k, v in out.items()})
        sd[name + ".weight"].copy_(back)
    _save(model, out_dir, tensors, ct_int4_config(group, symmetric))
    return model


# ---- fp8 -------------------------------------------------------------------------------------

def fake_quant_per_token(x: torch.Tensor) -> torch.Tensor:
    scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1.0 / (FP8_MAX * 512))
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


def fake_quant_per_token_slices(x: torch.Tensor, parts: int) -> torch.Tensor:
    """Per-token scales over each of ``parts`` equal slices of the features: what a row-parallel
    layer's ranks compute under tensor parallelism (each quantizes the slice it holds)."""
    return torch.cat([fake_quant_per_token(p) for p in x.chunk(parts, dim=-1)], dim=-1)


def fake_quant_static(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


def fake_quant_token_group(x: torch.Tensor, group: int) -> torch.Tensor:
    shape = x.shape
    g = x.reshape(-1, shape[-1] // group, group)
    scale = (g.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1.0 / (FP8_MAX * 512))
    return ((g / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale).reshape(shape)


def add_input_hooks(model, fake_quant_of: dict) -> None:
    """Each projection's input replaced by ``fake_quant_of[name](x)`` (the W8A8 reference)."""
    modules = dict(model.named_modules())
    for name, fq in fake_quant_of.items():
        modules[name].register_forward_pre_hook(lambda mod, args, fq=fq: (fq(args[0]),))


def write_fp8(out_dir: str, activation_scheme: str = "dynamic", **kw):
    """``quant_method: "fp8"``, per-tensor weight scales (q/k/v and gate/up each their own); static
    input scales differ between the fused projections (the engine takes their maximum)."""
    model = tiny_llama(out_dir, **kw)
    tensors, sd, hooks = {}, model.state_dict(), {}
    for j, name in enumerate(_projection_names(model)):
        w = sd[name + ".weight"]
        scale = w.abs().max() / FP8_MAX * (1.0 + 0.1 * (j % 3))  # not always the tightest scale
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        tensors[name + ".weight"] = q
        tensors[name + ".weight_scale"] = scale.reshape(())
        sd[name + ".weight"].copy_(q.float() * scale)
        if activation_scheme == "static":
            tensors[name + ".input_scale"] = torch.tensor(0.02 + 0.005 * (j % 3))
    if activation_scheme == "static":
        for name in _projection_names(model):
            layer, proj = name.rsplit(".", 1)
            fused = {"q_proj": ("q_proj", "k_proj", "v_proj"), "k_proj": ("q_proj", "k_proj", "v_proj"),
                     "v_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj"),
                     "up_proj": ("gate_proj", "up_proj")}.get(proj, (proj,))
            s = max(float(tensors[f"{layer}.{p}.input_scale"]) for p in fused)
            hooks[name] = lambda x, s=s: fake_quant_static(x, s)
    else:
        hooks = {name: fake_quant_per_token for name in _projection_names(model)}
    add_input_hooks(model, hooks)
    _save(model, out_dir, tensors, {"quant_method": "fp8", "activation_scheme": activation_scheme})
    return model


def write_fp8_block(out_dir: str, block: int = 32, **kw):
    """Block-wise fp8 as DeepSeek/Qwen3-FP8 ship it (``weight_scale_inv``), blocks of ``block``."""
    model = tiny_llama(out_dir, **kw)
    tensors, sd = {}, model.state_dict()
    for name in _projection_names(model):
        w = sd[name + ".weight"]
        n, k = w.shape
        tiles = w.view(n // block, block, k // block, block)
        scale = tiles.abs().amax(dim=(1, 3)) / FP8_MAX  # [N / b, K / b]
        q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        tensors[name + ".weight"] = q.view(n, k)
        tensors[name + ".weight_scale_inv"] = scale
        sd[name + ".weight"].copy_((q.float() * scale[:, None, :, None]).view(n, k))
    add_input_hooks(model, {name: (lambda x: fake_quant_token_group(x, block)) for name in _projection_names(model)})
    _save(model, out_dir, tensors, {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [block, block]})
    return model


def write_ct_fp8(out_dir: str, strategy: str = "channel", dynamic: bool = True, tp: int = 1, **kw):
    """float-quantized W8A8 by compressed-tensors' own qparams and compressor (activations dynamic
    per token, or a static per-tensor scale). ``tp``: the reference's row-parallel projections
    take their per-token scales per rank's slice, as the engine's ranks do."""
    from compressed_tensors.compressors import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    model = tiny_llama(out_dir, **kw)
    wargs = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy)
    aargs = (QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True) if dynamic
             else QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False))
    scheme = QuantizationScheme(targets=["Linear"], weights=wargs, input_activations=aargs)
    tensors, sd, hooks = {}, model.state_dict(), {}
    for name in _projection_names(model):
        w = sd[name + ".weight"]
        if strategy == "channel":
            scale, zp = calculate_qparams(w.amin(-1, keepdim=True), w.amax(-1, keepdim=True), wargs)
        else:
            scale, zp = calculate_qparams(w.min().reshape(1), w.max().reshape(1), wargs)
        out = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp},
                                                   scheme)
        out.pop("weight_zero_point", None)
        tensors.update({f"{name}.{k}": v for k, v in out.items()})
        sd[name + ".weight"].copy_(FloatQuantizationCompressor.decompress(dict(out), scheme)["weight"].float())
        if not dynamic:
            tensors[name + ".input_scale"] = torch.tensor([0.03])
            hooks[name] = lambda x: fake_quant_static(x, 0.03)
        elif tp > 1 and name.endswith(("o_proj", "down_proj")):
            hooks[name] = lambda x: fake_quant_per_token_slices(x, tp)
        else:
            hooks[name] = fake_quant_per_token
    add_input_hooks(model, hooks)
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="float-quantized",
                            quantization_status="compressed", ignore=["lm_head"])
    _save(model, out_dir, tensors, qc.model_dump(mode="json", exclude_none=True))
    return model


def write_dense(out_dir: str, **kw):
    model = tiny_llama(out_dir, **kw)
    _save(model, out_dir, {}, None)
    add_input_hooks(model, {})
    return model
