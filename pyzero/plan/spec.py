"""What the planner knows about a model: the shape of a GPT-style transformer.

A `ModelSpec` comes from a GPT spec (layers, hidden, heads, vocab, sequence,
batch), from an HF-style config (GPT-2's ``n_layer``/``n_embd``/``n_head`` or
the ``num_hidden_layers``/``hidden_size``/``num_attention_heads`` spelling),
or from a torch module: pyzero's bench GPT and HF GPT-2 by their config, any
other module by walking it: the largest ``nn.Embedding`` gives the vocabulary
and hidden size, a second one the positions, each MLP input layer
(``nn.Linear(h, 4h)``) a transformer layer, and a submodule attribute
``n_head``/``num_heads``/``num_attention_heads`` the heads (or ``heads=``).
Either way the parameters walked must match the shape's count within 5%.

Parameter count of one pre-LayerNorm block with hidden h and MLP ratio 4:
qkv 3h^2 + 3h, proj h^2 + h, fc 4h^2 + 4h, fc_proj 4h^2 + h, two LayerNorms
4h: 12h^2 + 13h. The model adds the token embedding V h (tied to the output
head, as GPT-2 and Megatron's GPT), the position embedding s h and the final
LayerNorm 2h.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from ..checks import is_int


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer and its training batch.

    ``batch``: global batch in sequences per optimizer step; ``seq``: tokens
    per sequence; ``ffn``: MLP hidden / hidden. ``embedding_tp``: the token
    embedding and output head are vocab-parallel under TP (Megatron) rather
    than replicated on every TP rank (pz.parallelize keeps them replicated).
    ``fused_attention``: the attention scores are recomputed inside a fused
    kernel rather than stored, so activation memory loses the 5as/h term (as
    with selective recomputation); the published tables assume stored scores.
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    batch: int
    ffn: int = 4
    tied_embedding: bool = True
    embedding_tp: bool = True
    name: str = "model"
    positions: int | None = None  # rows of the position embedding (default: seq)
    fused_attention: bool = False  # scores never stored (FlashAttention, torch SDPA): no 5as/h term

    def __post_init__(self):
        for arg in ("layers", "hidden", "heads", "vocab", "seq", "batch", "ffn"):
            v = getattr(self, arg)
            if not is_int(v) or v < 1:
                raise ValueError(f"{arg}: expected a positive int, got {v!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}; expected a multiple")

    @property
    def layer_params(self) -> int:
        h, f = self.hidden, self.ffn
        return (4 + 2 * f) * h * h + (9 + f) * h  # 12h^2 + 13h at f = 4

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        head = 0 if self.tied_embedding else self.vocab * self.hidden
        return self.layers * self.layer_params + self.embedding_params + head + self.position_params + 2 * self.hidden

    @property
    def position_params(self) -> int:
        return (self.positions or self.seq) * self.hidden

    def with_(self, **changes) -> "ModelSpec":
        return replace(self, **changes)


_KEYS = {  # ModelSpec field -> the names HF-style configs and pyzero's GPTConfig use
    "layers": ("n_layer", "num_hidden_layers", "num_layers"),
    "hidden": ("n_embd", "hidden_size", "d_model"),
    "heads": ("n_head", "num_attention_heads"),
    "vocab": ("vocab_size",),
    "seq": ("n_positions", "max_position_embeddings", "block_size", "n_ctx"),
}


def _get(config, names):
    for n in names:
        v = config.get(n) if isinstance(config, dict) else getattr(config, n, None)
        if v is not None:
            return v
    return None


def from_config(config, seq: int | None = None, batch: int = 1, name: str = "model") -> ModelSpec:
    """A ModelSpec from an HF-style config (object or dict) or pyzero's GPTConfig."""
    found = {k: _config_int(config, names) for k, names in _KEYS.items()}
    positions = found["seq"]
    if seq is not None:
        found["seq"] = seq
    missing = [f"{k} (one of {', '.join(_KEYS[k])})" for k, v in found.items() if v is None]
    if missing:
        raise ValueError(f"model: the config lacks {'; '.join(missing)}")
    _refuse_unlike_gpt(config)
    inner = _config_int(config, ("n_inner", "intermediate_size"))
    if inner is not None and (inner < 1 or inner % found["hidden"]):
        raise ValueError(f"model: the config's MLP size {inner} is not a whole multiple of its hidden size "
                         f"{found['hidden']}; the planner describes MLPs of ffn x hidden (e.g. GPT-2's 4)")
    ffn = 4 if inner is None else inner // found["hidden"]
    tied = _get(config, ("tie_word_embeddings",))
    return ModelSpec(ffn=ffn, batch=batch, name=name, positions=positions,
                     tied_embedding=True if tied is None else bool(tied), **found)


# Architectures whose MLP is gated (SwiGLU/GeGLU: three matrices), which the planner's GPT shape
# (two matrices, learned positions) would count wrongly.
_GATED = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "gemma", "gemma2", "gemma3", "phi3",
          "olmo", "olmo2", "cohere", "internlm", "deepseek_v2", "deepseek_v3", "granite")


def _refuse_unlike_gpt(config) -> None:
    """Raise for a config the GPT shape (multi-head attention, a two-matrix MLP) would misdescribe."""
    heads, kv = _get(config, ("n_head", "num_attention_heads")), _get(config, ("num_key_value_heads",))
    if kv is not None and heads is not None and kv != heads:
        raise ValueError(f"model: the config has grouped-query attention (num_key_value_heads={kv}, {heads} heads), "
                         "which the planner's GPT shape does not describe; expected a GPT-style model "
                         "(multi-head attention, learned positions, a two-matrix MLP)")
    kind = _get(config, ("model_type",))
    act = _get(config, ("hidden_act", "activation_function"))
    if kind in _GATED or (isinstance(act, str) and act.lower() in ("swiglu", "geglu", "reglu")):
        why = f"model_type={kind!r}" if kind in _GATED else f"activation {act!r}"
        raise ValueError(f"model: the config describes a gated MLP ({why}), which the planner's GPT shape (two MLP "
                         "matrices) does not describe; expected a GPT-style model such as GPT-2")


def _config_int(config, names):
    """The config's size under the first of `names` it has (None if none): an int, or a float with an
    integral value, as some JSON writers give."""
    key = next((n for n in names if _get(config, (n,)) is not None), None)
    if key is None:
        return None
    v = _get(config, (key,))
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if not is_int(v):
        raise ValueError(f"model: the config's {key}: expected an int, got {v!r}")
    return v


def to_spec(model, seq: int | None = None, batch: int | None = None, **shape) -> ModelSpec:
    """ModelSpec from a ModelSpec, a dict GPT spec, an HF-style config, or a torch module.

    ``seq``/``batch`` override the sequence length and global batch; ``shape``
    gives layers/hidden/heads/vocab for a module that carries no config.
    """
    allowed = ("layers", "hidden", "heads", "vocab")
    if set(shape) - set(allowed):
        raise ValueError(f"shape: expected keys from {allowed}, got {sorted(set(shape) - set(allowed))}")
    try:
        from torch import nn  # noqa: PLC0415
    except ImportError:  # pragma: no cover - torch is a dependency
        nn = None
    if shape and not (nn is not None and isinstance(model, nn.Module) and getattr(model, "config", None) is None):
        raise ValueError(f"shape: layers/hidden/heads/vocab describe a torch module without a config (found by "
                         f"walking it); {type(model).__name__} has its shape already, got shape={shape}")
    if isinstance(model, ModelSpec):
        out = model
    elif isinstance(model, dict) and "layers" in model:
        out = ModelSpec(**model)
    else:
        if nn is not None and isinstance(model, nn.Module):
            config = getattr(model, "config", None)
            if config is None:
                found = _walk(model, nn)
                found.update(shape)
                if "seq" not in found and seq is None:
                    raise ValueError("model: no position embedding found; give seq=")
                found["seq"] = seq or found["seq"]
                missing = [k for k in ("layers", "hidden", "heads", "vocab") if not found.get(k)]
                if missing:
                    raise ValueError(f"model: walking the module found no {', '.join(missing)}; give "
                                     f"{', '.join(k + '=' for k in missing)}")
                out = ModelSpec(batch=batch or 1, name=type(model).__name__, **found)
            else:
                out = from_config(config, seq=seq, batch=batch or 1, name=type(model).__name__)
            bench = sys.modules.get("pyzero.bench.gpt")  # (loaded wherever one of its GPTs exists)
            if bench is not None and isinstance(model, bench.GPT):
                # what pz.parallelize runs: embedding and head replicated over TP, attention in SDPA
                out = out.with_(embedding_tp=False, fused_attention=True)
            counted = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
            if not math.isclose(counted, out.params, rel_tol=0.05):
                raise ValueError(f"model: walking it counts {counted} parameters but its shape {out} implies "
                                 f"{out.params}; not a GPT-style model the planner can describe")
        else:
            out = from_config(model, seq=seq, batch=batch or 1)
    if seq is not None and out.positions is not None and seq > out.positions:
        raise ValueError(f"seq: expected at most the model's {out.positions} positions, got {seq}")
    changes = {k: v for k, v in (("seq", seq), ("batch", batch)) if v is not None}
    if seq is not None and out.positions is None:
        changes["positions"] = out.seq  # a shorter training sequence keeps the model's position table
    return out.with_(**changes) if changes else out


def _walk(model, nn) -> dict:
    """The transformer shape of a module without a config (see the module docstring)."""
    embeds = sorted((m for m in model.modules() if isinstance(m, nn.Embedding)), key=lambda m: -m.num_embeddings)
    # The token embedding is the one the output head (the last Linear) is tied to, or whose rows it
    # predicts (a position table larger than the vocabulary, as a character-level model's, is not);
    # else the largest.
    head = next((m for m in reversed(list(model.modules())) if isinstance(m, nn.Linear)), None)
    token = [] if head is None else [e for e in embeds if head.weight is e.weight] or \
        [e for e in embeds if (head.out_features, head.in_features) == (e.num_embeddings, e.embedding_dim)]
    if token:
        embeds.remove(token[0])
        embeds.insert(0, token[0])
    found: dict = {}
    if embeds:
        found["vocab"], found["hidden"] = embeds[0].num_embeddings, embeds[0].embedding_dim
        if len(embeds) > 1:
            found["seq"] = found["positions"] = embeds[1].num_embeddings
        h = found["hidden"]
        found["layers"] = sum(1 for m in model.modules()
                              if isinstance(m, nn.Linear) and m.in_features == h and m.out_features == 4 * h)
    for m in model.modules():
        for attr in ("n_head", "num_heads", "num_attention_heads"):
            if isinstance(getattr(m, attr, None), int):
                found["heads"] = getattr(m, attr)
                return found
    return found


# Published shapes, for the CLI and the tests.
PRESETS = {
    "gpt2-1.5b": dict(layers=48, hidden=1600, heads=25, vocab=50257, seq=1024, batch=512, name="GPT-2 1.5B"),
    "gpt3-175b": dict(layers=96, hidden=12288, heads=96, vocab=51200, seq=2048, batch=1536, name="GPT-3 175B"),
}
