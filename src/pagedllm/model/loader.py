"""Find a model (local folder, GGUF file, or HF cache), read its config and weights, build it."""
from __future__ import annotations

import inspect
import json
import logging
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn
from tqdm import tqdm

from pagedllm.model.gguf_cache import gguf_architecture, iterate_gguf_tensors_raw, load_gguf_config
from pagedllm.model.layers import Linear, RMSNorm
from pagedllm.model.gguf_cache import gguf_to_hf_name
from pagedllm.model.quantization import get_quantization_config
from pagedllm.model.quantization.base import checkpoint_prefixes, quant_config_context
from pagedllm.model.quantization.gguf import blocks_to_canonical, canonical_tensors
from pagedllm.model.registry import TEXT_MODEL_OF_MULTIMODAL, get_model_class

logger = logging.getLogger("pagedllm")

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
# ModelConfig.dtype (a name, so the config stays free of torch) -> the torch dtype of weights and activations.
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ResolvedModel:
    path: str  # folder holding the config / weights (for a GGUF file: its folder)
    gguf_file: str | None  # absolute path of the GGUF file, if the model is one
    hf_config: transformers.PretrainedConfig


def resolve_model(
    model: str,
    revision: str | None = None,
    trust_remote_code: bool = False,
    hf_overrides: dict | Callable | None = None,
) -> ResolvedModel:
    """Locate ``model`` on this machine (never downloads) and read its config."""
    path = Path(model).expanduser()
    if not path.exists():
        if model.startswith(("/", ".", "~")) or model.endswith(".gguf") or model.count("/") > 1:
            raise ValueError(f"model path {model!r} does not exist")
        path = Path(_cached_snapshot(model, revision))
    gguf_file = None
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model {model!r} is a file but not a .gguf file; give a folder or a .gguf file")
        # absolute(), not resolve(): HF cache snapshots are symlinks to blobs named by hash.
        gguf_file, path = str(path.absolute()), path.absolute().parent
    elif not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ValueError(
                f"model folder {str(path)!r} has no config.json and {len(ggufs)} .gguf files "
                f"({[g.name for g in ggufs]}); expected config.json or exactly one .gguf file")
        gguf_file = str(ggufs[0].absolute())
    if gguf_file is not None:
        config = load_gguf_config(gguf_file, trust_remote_code=trust_remote_code)
    else:
        config = _load_config(path, trust_remote_code)
    if not getattr(config, "architectures", None):  # GGUF configs only know their model_type
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        config.architectures = [arch] if arch else []
    return ResolvedModel(str(path), gguf_file, _text_config(_apply_overrides(config, hf_overrides)))


def _text_config(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """For a vision-language checkpoint served as its text model (Gemma 3), the text config,
    keeping the checkpoint's architecture name (which picks the weight-name mapping) and the
    top-level settings the text config lacks."""
    archs = list(getattr(config, "architectures", None) or [])
    text = getattr(config, "text_config", None)
    if not archs or archs[0] not in TEXT_MODEL_OF_MULTIMODAL or text is None:
        return config
    text.architectures = archs
    for key in ("dtype", "tie_word_embeddings"):
        if getattr(text, key, None) is None and getattr(config, key, None) is not None:
            setattr(text, key, getattr(config, key))
    return text


def _load_config(path: Path, trust_remote_code: bool) -> transformers.PretrainedConfig:
    """The model's config. Known model types load their config class directly: importing
    transformers' auto mapping costs seconds of start-up; AutoConfig handles the rest."""
    import importlib

    try:
        with open(path / "config.json") as f:
            raw = json.load(f)
        model_type = raw.get("model_type") if isinstance(raw, dict) else None
        config = _complete_config(raw) if model_type else None
        if config is not None:
            return config
        if model_type and not raw.get("auto_map") and model_type.isidentifier():
            module = importlib.import_module(f"transformers.models.{model_type}.configuration_{model_type}")
            for cls in vars(module).values():
                if isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig) \
                        and getattr(cls, "model_type", None) == model_type:
                    return cls.from_pretrained(str(path))
    except (OSError, ValueError, ImportError):
        pass  # AutoConfig below gives the real error, or handles the unusual case
    return transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)


# What the models read from a config, per model type, that transformers would otherwise default
# (its defaults differ between these classes, so none is guessed here).
_COMMON_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "rms_norm_eps", "max_position_embeddings",
                "tie_word_embeddings", "hidden_act")
_TYPE_KEYS = {"llama": (), "mistral": ("sliding_window",), "qwen2": (), "qwen3": ("head_dim",)}


def _complete_config(raw: dict) -> transformers.PretrainedConfig | None:
    """A plain PretrainedConfig holding config.json as written, when it spells out everything
    the models read: then the model type's config class (whose import drags in transformers'
    validators, activations and, where installed, torchvision with torch._dynamo: seconds of
    start-up) adds nothing. None sends the caller to that class."""
    model_type = raw.get("model_type")
    if model_type not in _TYPE_KEYS or raw.get("auto_map"):
        return None
    if any(k not in raw for k in _COMMON_KEYS + _TYPE_KEYS[model_type]):
        return None
    if "rope_parameters" not in raw and "rope_theta" not in raw:
        return None
    if model_type in ("qwen2", "qwen3") and "layer_types" not in raw and raw.get("sliding_window") \
            and raw.get("use_sliding_window") is not False:
        return None  # whether (and which) layers slide: the class works it out from its defaults
    from transformers.configuration_utils import PretrainedConfig

    # Set as written: the base class's __init__ would reinterpret some keys (rope_scaling).
    config = PretrainedConfig()
    for key, value in raw.items():
        setattr(config, key, value)
    return config


def _cached_snapshot(repo_id: str, revision: str | None) -> str:
    import huggingface_hub

    try:
        return huggingface_hub.snapshot_download(repo_id, revision=revision, local_files_only=True)
    except Exception as e:  # not cached, or not even a valid repo id
        raise ValueError(
            f"model {repo_id!r} is not a local path and not in the local HF cache "
            f"(revision {revision!r}); this engine runs offline, so download it first ({type(e).__name__})"
        ) from e


def _apply_overrides(config, hf_overrides):
    if hf_overrides is None:
        return config
    if callable(hf_overrides):
        return hf_overrides(config)
    for key, value in hf_overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, dict):
            setattr(config, key, {**current, **value})  # nested dicts update, not replace
        else:
            setattr(config, key, value)
    return config


def _progress(items, desc: str):
    return tqdm(items, desc=desc, disable=not sys.stderr.isatty(), leave=False)


def _indexed_files(folder: Path, index_name: str, pattern: str) -> list[Path]:
    index = folder / index_name
    if index.exists():  # sharded: the index names exactly the files that belong to the model
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(folder.glob(pattern))


def _safetensors_files(folder: Path) -> list[Path]:
    return _indexed_files(folder, "model.safetensors.index.json", "*.safetensors")


def _pt_files(folder: Path) -> list[Path]:
    return _indexed_files(folder, "pytorch_model.bin.index.json", "pytorch_model*.bin") or sorted(folder.glob("*.pt"))


def _gguf_path(resolved: ResolvedModel) -> str | None:
    if resolved.gguf_file:
        return resolved.gguf_file
    ggufs = sorted(Path(resolved.path).glob("*.gguf"))
    return str(ggufs[0]) if len(ggufs) == 1 else None


_LOOKED_FOR = {
    "safetensors": "model.safetensors.index.json or *.safetensors",
    "pt": "pytorch_model.bin.index.json, pytorch_model*.bin or *.pt",
    "gguf": "exactly one *.gguf",
}


def _detect_format(resolved: ResolvedModel) -> str:
    """safetensors, then .bin/.pt, then GGUF: the first the model has."""
    folder = Path(resolved.path)
    if resolved.gguf_file:
        return "gguf"
    if _safetensors_files(folder):
        return "safetensors"
    if _pt_files(folder):
        return "pt"
    if _gguf_path(resolved):
        return "gguf"
    raise ValueError(f"no weight files in {str(folder)!r}; looked for {'; '.join(_LOOKED_FOR.values())}")


def iterate_weights(resolved: ResolvedModel, load_format: str, quant_config=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, cpu_tensor)`` for every tensor of the checkpoint (GGUF with
    ``quantization="gguf"``: the 4-bit projections as the quantized layers' tensors)."""
    if load_format not in ("auto", "safetensors", "pt", "gguf"):
        raise ValueError(f"load_format {load_format!r} has no weight files; use one of {list(LOAD_FORMATS)}")
    folder = Path(resolved.path)
    if load_format == "auto":
        load_format = _detect_format(resolved)
    if load_format == "gguf":
        gguf_path = _gguf_path(resolved)
        if gguf_path is None:
            raise ValueError(f"no GGUF weights in {str(folder)!r}; looked for {_LOOKED_FOR['gguf']}")
        yield from _iterate_gguf(gguf_path, resolved.hf_config, quant_config)
        return
    files = _safetensors_files(folder) if load_format == "safetensors" else _pt_files(folder)
    if not files:
        raise ValueError(f"no {load_format} weights in {str(folder)!r}; looked for {_LOOKED_FOR[load_format]}")
    for file in _progress(files, f"Loading {load_format} weights"):
        if load_format == "safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            yield from torch.load(file, weights_only=True, map_location="cpu").items()


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time q/k row permutation (its rope pairs adjacent dims, HF's halves)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _iterate_gguf(gguf_path: str, config, quant_config=None) -> Iterator[tuple[str, torch.Tensor]]:
    permuted = gguf_architecture(gguf_path) == "llama"  # only llama's q/k rows are permuted
    n_heads = config.num_attention_heads
    n_kv_heads = getattr(config, "num_key_value_heads", None) or n_heads
    quantized = quant_config.types if getattr(quant_config, "name", None) == "gguf" else {}

    def keep_raw(name: str, qtype: int) -> bool:  # a projection that runs quantized: its blocks as they are
        hf_name = gguf_to_hf_name(name)
        return hf_name is not None and hf_name.endswith(".weight") and hf_name[:-len(".weight")] in quantized

    for name, array, qtype in _progress(list(iterate_gguf_tensors_raw(gguf_path, keep_raw)), "Loading GGUF weights"):
        hf_name = gguf_to_hf_name(name)
        if hf_name is None:
            continue
        heads = n_heads if ".self_attn.q_proj." in hf_name else n_kv_heads if ".self_attn.k_proj." in hf_name else None
        if qtype is not None:
            parts = blocks_to_canonical(array, qtype)
            if permuted and heads is not None:
                parts = {key: _unpermute_rope_rows(value, heads) for key, value in parts.items()}
            for suffix, tensor in canonical_tensors(parts).items():
                yield f"{hf_name[:-len('.weight')]}.{suffix}", tensor
            continue
        # Dequantized arrays are fresh; unquantized ones are read-only views of the mmap.
        weight = torch.from_numpy(array) if array.flags.writeable else torch.tensor(array)
        if permuted and heads is not None:
            weight = _unpermute_rope_rows(weight, heads)
        yield hf_name, weight


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    resolved: ResolvedModel, load_format: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
    max_model_len: int | None = None, convert: str = "none", quantization: str | None = None,
    model_cls: type[nn.Module] | None = None,
) -> nn.Module:
    """Build the model in ``dtype`` directly on ``device`` and fill its weights. ``max_model_len``
    (the engine's context limit) reaches model classes that take it (LongRoPE's choice).
    ``quantization``: the method its linear layers run (pagedllm.model.quantization; resolved
    from the engine args and the checkpoint's quantization_config). ``model_cls``: the class to
    build instead of the one its ``architectures`` name (an EAGLE head's config names its target's)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {list(LOAD_FORMATS)}")
    device = torch.device(device)
    model_cls = model_cls or get_model_class(getattr(resolved.hf_config, "architectures", None), convert)
    kwargs = {}
    if max_model_len is not None and "max_model_len" in inspect.signature(model_cls).parameters:
        kwargs["max_model_len"] = max_model_len
    gguf = load_format == "gguf" or (load_format == "auto" and _detect_format(resolved) == "gguf")
    if quantization is not None and gguf != (quantization == "gguf"):
        raise ValueError(f"quantization={quantization!r} with {'GGUF' if gguf else load_format} weights: GGUF weights "
                         "run quantized with quantization='gguf' only, and only GGUF weights do")
    quant_config = get_quantization_config(quantization, resolved.hf_config,
                                           gguf_file=_gguf_path(resolved) if gguf else None)
    # Parameters are allocated once, where they will live.
    with _default_dtype(dtype), device, quant_config_context(quant_config):
        model = model_cls(resolved.hf_config, **kwargs)
        if quant_config is not None:
            _attach_quant_methods(model, quant_config)
    model.quant_config = quant_config
    start = time.perf_counter()
    if load_format == "dummy":
        _init_dummy(model, seed, device)
    else:
        loaded = model.load_weights(iterate_weights(resolved, load_format, quant_config))
        missing = sorted({name for name, p in model.named_parameters() if not getattr(p, "optional", False)} - loaded)
        if missing:
            shown = ", ".join(missing[:10]) + (f", ... ({len(missing)} in all)" if len(missing) > 10 else "")
            raise ValueError(f"checkpoint in {resolved.path!r} lacks weights for: {shown}")
    if quant_config is not None:
        with _default_dtype(dtype), device, torch.no_grad():
            for module in reversed(list(model.modules())):  # children first: int4 experts stack their linears
                if getattr(module, "quant_method", None) is not None:
                    module.quant_method.process_after_loading(module)
        _producers_quantize_for_fp8(model)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once
    logger.info("Loaded %s (%s weights, %s, %s%s) in %.1f s: %.2f GiB", model_cls.__name__, load_format,
                str(dtype).removeprefix("torch."), device,
                f", {quant_config.name} quantized" if quant_config is not None else "", time.perf_counter() - start,
                weight_bytes / 2**30)
    return model.eval()


# (producer, projection) paths in a decoder layer where the producer's output is the projection's input.
_FP8_FEEDS = (("input_layernorm", "self_attn.qkv_proj"), ("post_attention_layernorm", "mlp.gate_up_proj"),
              ("mlp.act_fn", "mlp.down_proj"))


def _producers_quantize_for_fp8(model: nn.Module) -> None:
    """Where an fp8 W8A8 projection with per-token activations reads a (Llama-style) RMSNorm's or
    SiLU-and-mul's output, that kernel quantizes its output too (``RMSNorm.fp8_out``,
    ``SiluAndMul.fp8_out``) and the projection skips its own quantize launch."""
    from pagedllm import envs
    from pagedllm.model.layers import RMSNorm, SiluAndMul

    if not envs.PAGEDLLM_FP8_NORM_QUANT:
        return

    def find(module, path):
        for name in path.split("."):
            module = getattr(module, name, None)
        return module

    for module in model.modules():
        for producer_path, proj_path in _FP8_FEEDS:
            producer, proj = find(module, producer_path), find(module, proj_path)
            if type(producer) in (RMSNorm, SiluAndMul) and \
                    getattr(getattr(proj, "quant_method", None), "takes_fp8_rows", False):
                producer.fp8_out = True


def _attach_quant_methods(model: nn.Module, quant_config) -> None:
    """Give every quantizable linear its method (by its checkpoint names: ignore lists exempt some)."""
    from pagedllm.model.moe import FusedMoE
    from pagedllm.model.quantization.experts import experts_method

    stacked = getattr(model, "stacked_params", {})
    for name, module in list(model.named_modules()):  # int4 experts add per-expert linears, quantized already
        if isinstance(module, Linear) and module.weight is None and module.quant_method is None:
            module.set_quant_method(quant_config.method_for(module, name, checkpoint_prefixes(name, stacked)))
        elif isinstance(module, FusedMoE):
            module.set_quant_method(experts_method(quant_config, module, name, type(model).__name__))


@torch.no_grad()
def _init_dummy(model: nn.Module, seed: int, device: torch.device) -> None:
    """Deterministic small random weights: finite, varied outputs without a checkpoint. Each
    parameter's full (all-ranks) tensor is drawn from a generator seeded by ``seed`` and the
    tensor's checkpoint name, and its weight loader keeps this rank's slice, so any tensor or
    pipeline parallel split gives the same model."""
    generator = torch.Generator(device=device)
    norm_values = {id(p): m.dummy_value for m in model.modules() if isinstance(m, RMSNorm) for p in m.parameters()}
    for name, param in model.named_parameters():  # tied weights appear once
        if id(param) in norm_values:
            param.fill_(norm_values[id(param)])
            continue
        key = getattr(param, "checkpoint_name", name)
        generator.manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        full_shape = getattr(param, "full_shape", tuple(param.shape))
        # Quantized parameters (packed ints, fp8, scales) say how to fill them.
        fill = getattr(param, "dummy_fill", None) or (lambda t, g: t.normal_(0.0, 0.02, generator=g))
        if full_shape == tuple(param.shape):
            fill(param.data, generator)
        else:
            full = torch.empty(full_shape, dtype=param.dtype, device=param.device)
            fill(full, generator)
            param.weight_loader(param, full)
