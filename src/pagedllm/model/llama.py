"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat batch and paged KV cache."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagedllm import envs
from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.distributed import get_pp_rank, get_pp_size
from pagedllm.distributed.utils import pp_layer_range
from pagedllm.model import layers
from pagedllm.model.kv_scales import load_kv_scale
from pagedllm.model.layers import (
    GeluTanhAndMul, LMHead, MergedLinear, QKVLinear, RMSNorm, RotaryEmbedding, RowParallelLinear, SiluAndMul,
    VocabEmbedding, load_tensor,
)
from pagedllm.sample.sharded import VocabShard


class Attention(nn.Module):
    """Self-attention; the model runner sets ``kv_cache`` and ``attn_backend`` before use."""

    def __init__(self, config, layer_idx: int, rotary_emb: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, *, scale: float | None = None, logits_soft_cap: float | None = None,
                 norm_cls: type[RMSNorm] = RMSNorm):
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self.logits_soft_cap = logits_soft_cap
        self.sliding_window = _sliding_window(config, layer_idx)
        self.layer_idx = layer_idx
        # Its KV cache group (core/kv_cache_groups.py), set by the model runner: where several
        # groups exist, the step's metadata holds a block table and slot mapping for each.
        self.kv_cache_group = 0
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, total_heads, total_kv_heads, qkv_bias)
        # This rank's heads (all of them with one rank); its KV cache holds only its KV heads.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, o_bias)
        if qk_norm:  # Qwen3, Gemma 3: per-head RMSNorm of q and k before rotary
            self.q_norm = norm_cls(self.head_dim, config.rms_norm_eps)
            self.k_norm = norm_cls(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.fused_qk_norm = qk_norm and norm_cls is RMSNorm  # the Triton kernel rounds as RMSNorm does
        self.rotary_emb = rotary_emb  # one cos/sin table shared by all layers
        self.kv_cache: torch.Tensor | None = None  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        self.attn_backend: AttentionBackend | None = None
        # An fp8 KV cache's [k_scale, v_scale] (attention/kv_quant.py): from the checkpoint
        # (model/kv_scales.py), else 1.0, or set by the first step with calculate_kv_scales.
        self.register_buffer("kv_scale", torch.ones(2, dtype=torch.float32), persistent=False)
        self.kv_scale_from_checkpoint = False

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.attend(positions, q, k, v, attn_metadata)

    def attend(self, positions, q, k, v, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """q/k norm, rotary, paged attention and o_proj of the projected [T, size] q, k, v."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        ops = layers.triton_ops_for(q)  # looked up at call time: one switch for every layer
        if self.attn_backend is None:
            raise RuntimeError("Attention.attn_backend is not set; the model runner must set it before forward")
        if self.kv_cache_group:
            attn_metadata = attn_metadata.for_group(self.kv_cache_group)
        backend = self.attn_backend
        if backend.fuses_rotary and ops is not None and self.rotary_emb.fused_ok(q, k) \
                and self.fused_qk_norm == self.qk_norm:
            # q/k norm, rotary and the KV write in one launch, then attention over the cache.
            norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else ()
            q = backend.rotary_write_kv(positions, q, k, v, self.kv_cache, attn_metadata,
                                        self.rotary_emb.cos_sin_cache, *norm, kv_scale=self.kv_scale)
            o = backend.attend(q, self.kv_cache, attn_metadata, self.scale, self.sliding_window,
                               logits_soft_cap=self.logits_soft_cap, kv_scale=self.kv_scale)
            return self.o_proj(o.flatten(1, 2))
        if self.fused_qk_norm and ops is not None and self.rotary_emb.fused_ok(q, k):  # one launch for all three
            q, k = ops.qk_norm_rotary(positions, q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                      self.rotary_emb.cos_sin_cache)
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
        o = backend.forward(q, k, v, self.kv_cache, attn_metadata, self.scale, self.sliding_window,
                            logits_soft_cap=self.logits_soft_cap, kv_scale=self.kv_scale)
        return self.o_proj(o.flatten(1, 2))


def _sliding_window(config, layer_idx: int) -> int | None:
    """Per-layer window: from ``layer_types`` when the config has them (Qwen2, transformers 5)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window if getattr(config, "use_sliding_window", True) else None


_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul, "gelu_tanh": GeluTanhAndMul}


class MLP(nn.Module):
    def __init__(self, config, bias: bool, hidden_act: str | None = None):
        super().__init__()
        hidden_act = hidden_act or getattr(config, "hidden_act", "silu")
        if hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {hidden_act!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
        self.gate_up_proj = MergedLinear(config.hidden_size, [config.intermediate_size] * 2, bias)
        self.act_fn = _ACTIVATIONS[hidden_act]()
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rotary_emb: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, norm_cls: type[nn.Module] = RMSNorm, attn_cls: type[Attention] = Attention,
                 mlp: nn.Module | None = None):
        """``mlp``: the feed-forward block when it is not the dense MLP (a mixture of experts)."""
        super().__init__()
        self.self_attn = attn_cls(config, layer_idx, rotary_emb, qkv_bias, o_bias, qk_norm)
        self.mlp = mlp if mlp is not None else MLP(config, bias=getattr(config, "mlp_bias", False))
        self.input_layernorm = norm_cls(config.hidden_size, getattr(config, "rms_norm_eps", 1e-6))
        self.post_attention_layernorm = norm_cls(config.hidden_size, getattr(config, "rms_norm_eps", 1e-6))

    def forward(self, positions, hidden_states, residual, attn_metadata):
        # The residual stream is carried separately so each norm can fuse the add.
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class MissingLayer(nn.Identity):
    """A layer held by another pipeline stage: keeps the indices (and checkpoint names) of
    the layers this stage does hold."""


class LlamaModel(nn.Module):
    """With pipeline parallelism this stage holds layers [start_layer, end_layer): the first
    stage also the embedding, the last the final norm. A stage other than the first takes the
    previous stage's (hidden_states, residual); one other than the last returns them."""

    def __init__(self, config, make_layer: Callable[[int], nn.Module], rotary_emb: nn.Module,
                 norm_cls: type[RMSNorm] = RMSNorm, embed_scale: float | None = None):
        super().__init__()
        pp_rank, pp_size = get_pp_rank(), get_pp_size()
        self.is_first_stage, self.is_last_stage = pp_rank == 0, pp_rank == pp_size - 1
        self.start_layer, self.end_layer = pp_layer_range(config.num_hidden_layers, pp_rank, pp_size)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size) if self.is_first_stage else None
        self.embed_scale = embed_scale  # Gemma: embeddings times sqrt(hidden_size), rounded to the model dtype
        self.rotary_emb = rotary_emb  # shared by the layers (Gemma 3: one per layer type)
        self.layers = nn.ModuleList(
            make_layer(i) if self.start_layer <= i < self.end_layer else MissingLayer()
            for i in range(config.num_hidden_layers))
        self.norm = norm_cls(config.hidden_size, getattr(config, "rms_norm_eps", 1e-6)) if self.is_last_stage else None
        # EAGLE-3 (worker/spec_eagle.py): {layer index: its columns} in aux_hidden_states; None: nothing kept.
        self._aux_columns: dict[int, slice] | None = None
        self.aux_hidden_states: torch.Tensor | None = None

    def capture_aux_hidden_states(self, layer_ids: list[int], max_tokens: int) -> torch.Tensor:
        """From now on every forward also writes the residual stream entering each layer of
        ``layer_ids`` (the sum of the hidden state and residual a layer receives) into one
        [max_tokens, len(layer_ids) * hidden] buffer, row i for the step's token i, and returns it.
        The buffer is allocated once, so CUDA graphs captured afterwards refill it on replay."""
        hidden = self.layers[layer_ids[0]].input_layernorm.weight
        self._aux_columns = {i: slice(j * hidden.shape[0], (j + 1) * hidden.shape[0]) for j, i in enumerate(layer_ids)}
        self.aux_hidden_states = torch.zeros(max_tokens, len(layer_ids) * hidden.shape[0], dtype=hidden.dtype,
                                             device=hidden.device)
        return self.aux_hidden_states

    def forward(self, input_ids, positions, attn_metadata, intermediate_tensors=None):
        if self.is_first_stage:
            hidden_states, residual = self.embed_tokens(input_ids), None
            if self.embed_scale is not None:
                hidden_states = hidden_states * self.embed_scale
        else:
            hidden_states, residual = intermediate_tensors
        aux = self._aux_columns
        for i in range(self.start_layer, self.end_layer):
            if aux is not None and i in aux:
                stream = hidden_states if residual is None else hidden_states + residual
                self.aux_hidden_states[:stream.shape[0], aux[i]].copy_(stream)
            hidden_states, residual = self.layers[i](positions, hidden_states, residual, attn_metadata)
        if not self.is_last_stage:
            return hidden_states, residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def holds_weight(self, name: str) -> bool:
        """Whether a checkpoint tensor belongs to this pipeline stage."""
        if name.startswith("model.layers."):
            return self.start_layer <= int(name.split(".")[2]) < self.end_layer
        if name.startswith("model.embed_tokens."):
            return self.is_first_stage
        if name.startswith(("model.norm.", "lm_head.")):
            return self.is_last_stage
        return True


class LlamaForCausalLM(nn.Module):
    """Llama and Mistral; subclasses only change which projections carry biases/norms."""

    # checkpoint name part -> (our fused parameter name part, shard id)
    stacked_params = {
        ".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
    }
    qk_norm = False
    norm_cls: type[RMSNorm] = RMSNorm

    def __init__(self, config, max_model_len: int | None = None):
        """``max_model_len``: the engine's context limit (LongRoPE picks its factors by it)."""
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        rotary = self.make_rotary(config, max_model_len)
        self.model = LlamaModel(config, lambda i: self.make_layer(config, i, rotary), rotary, self.norm_cls,
                                self.embed_scale(config))
        self.lm_head = None
        if self.model.is_last_stage:
            # Tied on one stage: the head shares the embedding. When the embedding lives on
            # another stage, the head holds its own copy, loaded from the embedding's tensor.
            tie_to = self.model.embed_tokens if self.tie_word_embeddings else None
            self.lm_head = LMHead(config.vocab_size, config.hidden_size, tie_to=tie_to)
            if self.tie_word_embeddings and tie_to is None:
                self.lm_head.weight.checkpoint_name = "model.embed_tokens.weight"

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias); Llama and Qwen3 put ``attention_bias`` on both."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    @staticmethod
    def make_rotary(config, max_model_len: int | None) -> nn.Module:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return RotaryEmbedding(head_dim, config.max_position_embeddings, config, max_model_len=max_model_len)

    def make_layer(self, config, layer_idx: int, rotary: nn.Module) -> nn.Module:
        return DecoderLayer(config, layer_idx, rotary, *self.attention_biases(config), qk_norm=self.qk_norm)

    @staticmethod
    def embed_scale(config) -> float | None:
        return None

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """Our name for a checkpoint tensor's (None: not part of the text model, skipped)."""
        return name

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
        intermediate_tensors: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """[num_tokens, hidden_size], final-normed; on a stage before the last, the
        (hidden_states, residual) pair for the next stage."""
        return self.model(input_ids, positions, attn_metadata, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor, shard: bool = False) -> torch.Tensor | VocabShard:
        """Logits in the model dtype; the sampler and logprobs upcast where they need to. ``shard``, under
        tensor parallelism: this rank's vocabulary slice, not gathered (the sampler gathers what it needs)."""
        head = self.lm_head
        if shard and head.tp_size > 1 and envs.PAGEDLLM_SHARDED_SAMPLING:
            return VocabShard(layers.linear(hidden_states, head.weight), head.vocab_start,
                              head.vocab_end - head.vocab_start, head.vocab_size)
        return head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns our parameter names whose every shard was loaded."""
        params = dict(self.named_parameters())
        shards_seen: dict[str, set] = {}
        head_from_embedding = self.lm_head is not None and getattr(self.lm_head.weight, "checkpoint_name", None)
        quant_config = getattr(self, "quant_config", None)
        for name, tensor in weights:
            name = self.checkpoint_name(name)
            if name is None or "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if head_from_embedding and name == head_from_embedding:
                self.lm_head.weight.weight_loader(self.lm_head.weight, tensor)
                shards_seen.setdefault("lm_head.weight", set()).add(None)
                continue
            if not self.model.holds_weight(name):
                continue  # another pipeline stage's
            if load_kv_scale(self, name, tensor):  # an fp8 KV cache's k_scale / v_scale: a buffer
                continue
            name, shard_id = self.stacked_name(name)
            if name is None:
                continue  # a tensor this rank holds no parameter for (another rank's whole expert)
            if name not in params and quant_config is not None and (name.endswith(".bias")
                                                                     or quant_config.skips_tensor(name)):
                # GPTQ checkpoints may store zero biases of layers that have none; compressed-tensors'
                # shape records; KV-cache scales where the model reads none
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            load_tensor(params[name], tensor, shard_id, repr(name))
            shards_seen.setdefault(name, set()).add(shard_id)
        loaded = set()
        for name, seen in shards_seen.items():
            if None in seen or self.shards_needed(name) <= seen:  # a fused tensor in the checkpoint covers all
                loaded.add(name)
        return loaded

    def stacked_name(self, name: str) -> tuple[str, object]:
        """(our parameter name, shard id) of a checkpoint tensor: a fused parameter's part gets
        its shard id, any other tensor None; name None: not this rank's (skipped)."""
        for part, (fused_part, shard) in self.stacked_params.items():
            if part in name:
                return name.replace(part, fused_part), shard
        return name, None

    def shards_needed(self, name: str) -> set:
        """The shard ids that together fill parameter ``name`` ({None}: it loads whole)."""
        expected = {".qkv_proj.": {"q", "k", "v"}, ".gate_up_proj.": {0, 1}}
        return next((shards for part, shards in expected.items() if part in name), {None})


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return True, False  # Qwen2 always has q/k/v biases and never an o_proj bias


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4-mini: the checkpoint holds q/k/v and gate/up already fused (``qkv_proj``,
    ``gate_up_proj``: our fused layers load them whole, each rank keeping its slices); LongRoPE
    and partial rotary come from the rope parameters."""
