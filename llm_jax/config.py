"""Model configuration: one frozen dataclass for every decoder family llm_jax runs.

Families differ by switches on :class:`ModelConfig` (q/k/v bias, q/k norm, GeGLU, soft-capping, ...),
never by a copy of the decoder. Converters (``llm_jax.weights``) translate each source format into it.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import jax.numpy as jnp


class ConfigError(ValueError):
    """An invalid or self-contradictory model configuration."""


class Activation(enum.Enum):
    """The gate nonlinearity of the gated MLP: SwiGLU (Llama) or GeGLU with tanh-GELU (Gemma)."""

    SILU = "silu"
    GELU_TANH = "gelu_tanh"


class QKNormScope(enum.Enum):
    """What the q/k RMSNorm (``qk_norm``) normalises: each head's H values on their own, one [H] scale shared by
    the heads (Qwen3, Gemma 3), or each token's whole projection at once, N·H query and K·H key values with a
    scale per head and dimension, [N, H] and [K, H] (OLMo 2, OLMo 3)."""

    HEAD = "head"
    ALL_HEADS = "all_heads"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DefaultRope:
    """Plain RoPE: inverse frequencies ``theta ** (-2i / H)``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearRope:
    """Position interpolation: every inverse frequency divided by ``factor``."""

    factor: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Llama3Rope:
    """Llama 3.1 / 3.2 frequency-dependent scaling (``rope_type: llama3`` in Hugging Face configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class LongRope:
    """Phi-3's LongRoPE (Ding et al. 2024; ``rope_type: longrope``, once ``su``): each rotary frequency divided
    by its own factor, ``short_factor`` [R/2] while a sequence is at most ``original_max_position_embeddings``
    tokens long, ``long_factor`` [R/2] beyond; cos and sin multiplied by ``attention_factor`` (sqrt(1 + log(s) /
    log(orig)) for an extension s = max / orig, as the converter resolves it).

    Which set a token uses follows ``transformers``' forward: the long set where its sequence is longer than
    ``original_max_position_embeddings`` — a prompt's length for the prompt's tokens, a decoded token's own
    position + 1. Keys already in a KV cache keep the rotation they were written with, never re-encoded (the
    README's "Models and checkpoints")."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):
            try:
                object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))
            except (TypeError, ValueError):
                raise ConfigError(f"longrope {name} must be a list of numbers, got {getattr(self, name)!r}") from None
            if not all(x > 0 for x in getattr(self, name)):
                raise ConfigError(f"longrope {name} must hold positive numbers, got {list(getattr(self, name))}")
        if len(self.short_factor) != len(self.long_factor):
            raise ConfigError(f"longrope short_factor has {len(self.short_factor)} entries but long_factor has "
                              f"{len(self.long_factor)}; each has one per rotary frequency")
        orig = self.original_max_position_embeddings
        if not isinstance(orig, int) or isinstance(orig, bool) or orig < 1:
            raise ConfigError(f"longrope original_max_position_embeddings must be a positive integer, got {orig!r}")
        if not self.attention_factor > 0:
            raise ConfigError(f"longrope attention_factor must be positive, got {self.attention_factor!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnRope:
    """YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models"; ``rope_type:
    yarn``): each rotary frequency interpolated (divided by ``factor``), extrapolated (kept) or blended, by how many
    turns it makes over ``original_max_position_embeddings`` tokens (§3.2, "NTK-by-parts": kept above
    ``beta_fast`` turns, divided below ``beta_slow``, a linear ramp over the rotary dimensions between), and cos
    and sin multiplied by an attention factor (§3.4): ``attention_factor``, or None for the paper's
    0.1·ln(factor) + 1 (1 where factor <= 1). ``truncate`` rounds the ramp's ends to whole dimensions (floor,
    ceil), as the paper's code and llama.cpp do; gpt-oss turns it off. Frequencies are those of the R rotary
    dimensions (``ModelConfig.rope_dim``). DeepSeek's ``mscale`` / ``mscale_all_dim`` ratio, and a missing
    ``factor``, are resolved by the converter (``weights.hf_config``), as transformers resolves them."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        for name in ("factor", "beta_fast", "beta_slow"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"yarn {name} must be a positive number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.beta_fast < self.beta_slow:
            raise ConfigError(f"yarn beta_fast={self.beta_fast} must be at least beta_slow={self.beta_slow} (the "
                              "ramp runs from the fast, extrapolated frequencies to the slow, interpolated ones)")
        orig = self.original_max_position_embeddings
        if not isinstance(orig, int) or isinstance(orig, bool) or orig < 1:
            raise ConfigError(f"yarn original_max_position_embeddings must be a positive integer, got {orig!r}")
        if self.attention_factor is not None:
            if isinstance(self.attention_factor, bool) or not isinstance(self.attention_factor, int | float) \
                    or not self.attention_factor > 0:
                raise ConfigError(f"yarn attention_factor must be a positive number or None, got "
                                  f"{self.attention_factor!r}")
            object.__setattr__(self, "attention_factor", float(self.attention_factor))
        if not isinstance(self.truncate, bool):
            raise ConfigError(f"yarn truncate must be true or false, got {self.truncate!r}")

    @property
    def cos_sin_scale(self) -> float:
        """What cos and sin are multiplied by: ``attention_factor``, else 0.1·ln(factor) + 1 (YaRN's §3.4)."""
        if self.attention_factor is not None:
            return self.attention_factor
        return yarn_mscale(self.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 · mscale · ln(factor) + 1 (1 where factor <= 1), as transformers'
    ``yarn_get_mscale``; DeepSeek's attention factor is the ratio of two of them."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


RopeScaling = DefaultRope | LinearRope | Llama3Rope | LongRope | YarnRope


class Problem(enum.Enum):
    """What a classifier's logits mean (``transformers``' ``problem_type``), and so how they become
    probabilities, as vLLM's ``/classify`` turns them: one class of many (softmax; a single logit: sigmoid),
    independent labels (a sigmoid each), or a regression (the logits as they are)."""

    SINGLE_LABEL = "single_label_classification"
    MULTI_LABEL = "multi_label_classification"
    REGRESSION = "regression"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Classifier:
    """A sequence-classification head in place of the LM head (``*ForSequenceClassification``: reward
    models, classifiers, rerankers): ``score`` [D, C] reads the last token's final hidden state."""

    labels: tuple[str, ...]  # C: each class's name (``id2label``)
    problem: Problem = Problem.SINGLE_LABEL

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", tuple(str(label) for label in self.labels))
        object.__setattr__(self, "problem", Problem(self.problem))
        if not self.labels:
            raise ConfigError("a classifier needs at least one label")

    @property
    def num_labels(self) -> int:
        return len(self.labels)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Experts:
    """A sparse mixture-of-experts MLP in place of the dense one (Mixtral, Qwen2-MoE, Qwen3-MoE): E gated MLPs of
    width ``d_ff`` and a router [D, E]. Each token's router logits go through a softmax over all E experts
    (float32); its ``top_k`` most probable experts run, and their outputs are summed weighted by those
    probabilities, renormalised to sum to 1 over the k when ``normalize_top_k`` (Mixtral; Qwen's
    ``norm_topk_prob``). ``shared_d_ff``: a shared expert besides them (Qwen2-MoE), a gated MLP of that width
    that every token runs, its output scaled by ``sigmoid(x · shared_expert_gate)`` (a [D] vector) and added;
    None: none."""

    num_experts: int  # E
    top_k: int  # U: experts each token uses
    normalize_top_k: bool = True
    shared_d_ff: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ConfigError(f"experts num_experts must be a positive integer, got {self.num_experts!r}")
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"experts top_k must be an integer from 1 to num_experts={self.num_experts}, got "
                              f"{self.top_k!r}")
        if not isinstance(self.normalize_top_k, bool):
            raise ConfigError(f"experts normalize_top_k must be true or false, got {self.normalize_top_k!r}")
        if self.shared_d_ff is not None and (not isinstance(self.shared_d_ff, int) or isinstance(self.shared_d_ff, bool)
                                             or self.shared_d_ff < 1):
            raise ConfigError(f"experts shared_d_ff must be a positive integer or None, got {self.shared_d_ff!r}")

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON values; ``shared_d_ff`` left out while None, so that configs without a shared
        expert read (and hash) as before it existed."""
        out = dataclasses.asdict(self)
        if self.shared_d_ff is None:
            del out["shared_d_ff"]
        return out


class NoLanguageModelHead(ConfigError):
    """Asked for token logits (generation, scoring) of a model whose head is a classifier's."""


# The projections of every family's layers, by name (``llm_jax.quantization.PROJECTIONS`` groups them).
PROJECTION_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantScheme:
    """How one weight is stored as integers (``llm_jax.quantization``): ``bits`` 8 or 4; ``group_size``
    inputs share a float32 scale (None: one scale per output channel, the group spanning all inputs);
    ``offsets``: each group also has a float32 offset (asymmetric: W = s · q + o, as llama.cpp's Q4_1 and
    K-quants store it), else symmetric (W = s · q)."""

    bits: int
    group_size: int | None = None
    offsets: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (8, 4):
            raise ConfigError(f"quantization bits must be 8 or 4, got {self.bits!r}")
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size <= 0):
            raise ConfigError(f"quantization group_size must be a positive integer or None, got {self.group_size!r}")
        if not isinstance(self.offsets, bool):
            raise ConfigError(f"quantization offsets must be true or false, got {self.offsets!r}")

    @property
    def plain(self) -> QuantScheme:
        """The scheme alone (a :class:`Quantization` without its other fields)."""
        return QuantScheme(bits=self.bits, group_size=self.group_size, offsets=self.offsets)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Quantization(QuantScheme):
    """Weights stored as integers (``llm_jax.quantization``): every projection in this scheme, except
    those ``projections`` names ((name, scheme) pairs, a scheme None keeping that projection in floats: the
    mixes of a GGUF file; a mixture's experts, and its shared expert, go by the MLP's names ``gate_proj``,
    ``up_proj``, ``down_proj``; its router stays in floats). ``embedding``: the embedding table's scheme
    (groups along d_model), None for floats; ``lm_head``: an untied LM head's. ``embedding=True`` is both
    in int8 per row (per output channel of the head), ``False`` neither."""

    embedding: QuantScheme | None = None
    lm_head: QuantScheme | None = None
    projections: tuple[tuple[str, QuantScheme | None], ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.embedding, bool):  # the int8 tables of --quantize-embedding
            table = QuantScheme(bits=8) if self.embedding else None
            object.__setattr__(self, "embedding", table)
            if self.lm_head is None:
                object.__setattr__(self, "lm_head", table)
        for name in ("embedding", "lm_head"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, QuantScheme) or isinstance(value, Quantization)):
                raise ConfigError(f"quantization {name} must be a QuantScheme, true, false or None, got {value!r}")
        names = [name for name, _ in self.projections]
        unknown = sorted(set(names) - set(PROJECTION_NAMES))
        if unknown or len(set(names)) != len(names):
            raise ConfigError(f"quantization projections must name each of {PROJECTION_NAMES} at most once, got "
                              f"{names}")
        if any(s is not None and (not isinstance(s, QuantScheme) or isinstance(s, Quantization))
               for _, s in self.projections):
            raise ConfigError(f"quantization projections must map names to QuantScheme s or None, got "
                              f"{self.projections!r}")

    def scheme(self, name: str) -> QuantScheme | None:
        """The scheme of projection ``name`` (None: kept in floats)."""
        return dict(self.projections).get(name, self.plain)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Quantization:
        data = dict(data)
        pairs = data.pop("projections", ())
        try:
            projections = tuple((str(name), None if scheme is None else QuantScheme(**scheme))
                                for name, scheme in pairs)
            for name in ("embedding", "lm_head"):  # a scheme, or (configs of earlier versions) true / false
                if isinstance(data.get(name), dict):
                    data[name] = QuantScheme(**data[name])
            return cls(**data, projections=projections)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"invalid quantization {data!r}: {e}") from None

# Runtime choices that configs saved by earlier versions hold; how a model runs is its backend's
# (``llm_jax.backends``), not the model's, and reading such a config ignores them.
_RUNTIME_FIELDS = ("attention_impl", "matmul_impl")
# Fields added after the first checkpoints were written: left out of a config's JSON while None, so that
# configs without them read (and hash, in the training logs) as before.
_LATER_FIELDS = ("rotary_dim", "sliding_rope_theta", "experts", "quantization", "classifier")
# Switches added later, left out of a config's JSON while at these defaults, for the same reason.
_LATER_DEFAULTS: dict[str, Any] = {"pre_norm": True, "qk_norm_scope": QKNormScope.HEAD}


def _dtype_name(dtype: Any) -> str:
    return jnp.dtype(dtype).name


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and behaviour of a decoder-only transformer.

    Hashable, so it can be a static argument of jitted functions. Dtypes are stored as names
    (``"float32"``, ``"bfloat16"``); use :attr:`param_jnp_dtype` / :attr:`compute_jnp_dtype`.
    """

    vocab_size: int  # V
    d_model: int  # D
    n_layers: int  # L
    n_heads: int  # N
    n_kv_heads: int  # K
    head_dim: int  # H
    d_ff: int  # F
    max_seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling = DefaultRope()
    # R: the leading dimensions of each head that RoPE rotates (Phi-4-mini: 3/4 of H), the rest passing through
    # unrotated; None: all H.
    rotary_dim: int | None = None
    tie_embeddings: bool = False
    param_dtype: str = "float32"
    compute_dtype: str = "float32"

    # Family switches (Llama defaults).
    activation: Activation = Activation.SILU
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k before RoPE, over what ``qk_norm_scope`` says
    qk_norm_scope: QKNormScope = QKNormScope.HEAD  # OLMo 2: ALL_HEADS, each token's whole q and k
    norm_weight_offset: float = 0.0  # Gemma: RMSNorm scales by (offset + w)
    embed_scale: bool = False  # Gemma: embeddings multiplied by sqrt(D)
    sandwich_norm: bool = False  # Gemma 2: extra norms after attention and after the MLP
    # False (OLMo 2): no norms before attention and the MLP, only the sandwich's after them, so that a layer is
    # x + norm(attn(x)), then x + norm(mlp(x)); the residual stream itself is normed only by the final norm.
    pre_norm: bool = True
    query_pre_attn_scalar: float | None = None  # Gemma 2: scale = this ** -0.5 instead of H ** -0.5
    attn_logit_softcap: float | None = None  # Gemma 2
    final_logit_softcap: float | None = None  # Gemma 2
    sliding_window: int | None = None  # Mistral / Gemma 2 local layers
    # Per layer: True where the layer uses ``sliding_window``. None means every layer does (when a
    # window is set). Gemma 2 alternates local and global layers.
    sliding_layers: tuple[bool, ...] | None = None
    # Gemma 3, OLMo 3: the RoPE base of the sliding-window layers, which rotate by plain RoPE (no ``rope_scaling``);
    # None: they rotate as the global layers do (``rope_theta``, ``rope_scaling``).
    sliding_rope_theta: float | None = None
    # Mixtral / Qwen2-MoE / Qwen3-MoE: every layer's MLP is a sparse mixture of ``d_ff``-wide experts; None: dense.
    experts: Experts | None = None
    # Integer weights (``llm_jax.quantization``): how the stored projections are quantized; None: floats.
    quantization: Quantization | None = None
    # A sequence classifier's head (``score``) instead of the LM head; None: a language model.
    classifier: Classifier | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_dtype", _dtype_name(self.param_dtype))
        object.__setattr__(self, "compute_dtype", _dtype_name(self.compute_dtype))
        object.__setattr__(self, "activation", Activation(self.activation))
        try:
            object.__setattr__(self, "qk_norm_scope", QKNormScope(self.qk_norm_scope))
        except ValueError:
            raise ConfigError(f"qk_norm_scope must be one of {[s.value for s in QKNormScope]}, got "
                              f"{self.qk_norm_scope!r}") from None
        if self.sliding_layers is not None:
            object.__setattr__(self, "sliding_layers", tuple(bool(x) for x in self.sliding_layers))
        if self.rotary_dim is not None and self.rotary_dim == self.head_dim:
            object.__setattr__(self, "rotary_dim", None)  # every dimension rotates: the plain config
        self._validate()

    def _validate(self) -> None:
        positive = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                    "max_seq_len")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} "
                "(grouped-query attention shares each kv head among n_heads // n_kv_heads query heads)")
        if self.rotary_dim is not None and (not isinstance(self.rotary_dim, int) or isinstance(self.rotary_dim, bool)
                                            or not 0 < self.rotary_dim < self.head_dim or self.rotary_dim % 2):
            raise ConfigError(f"rotary_dim must be an even integer from 2 to head_dim={self.head_dim}, or None, got "
                              f"{self.rotary_dim!r}")
        if self.rope_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if not self.norm_eps > 0:
            raise ConfigError(f"norm_eps must be positive, got {self.norm_eps}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta}")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise ConfigError(f"{name} must be float32, bfloat16 or float16, got {getattr(self, name)!r}")
        if not isinstance(self.pre_norm, bool):
            raise ConfigError(f"pre_norm must be true or false, got {self.pre_norm!r}")
        if self.qk_norm_scope is not QKNormScope.HEAD and not self.qk_norm:
            raise ConfigError(f"qk_norm_scope={self.qk_norm_scope.value!r} needs qk_norm=True (it says what the "
                              "q/k norm normalises)")
        if not self.pre_norm and not self.sandwich_norm:
            raise ConfigError("pre_norm=False needs sandwich_norm=True: without either, a layer's sub-blocks are "
                              "never normed (OLMo 2 norms their outputs only)")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window must be positive or None, got {self.sliding_window}")
        if self.sliding_layers is not None:
            if len(self.sliding_layers) != self.n_layers:
                raise ConfigError(
                    f"sliding_layers has {len(self.sliding_layers)} entries but n_layers={self.n_layers}")
            if any(self.sliding_layers) and self.sliding_window is None:
                raise ConfigError("sliding_layers marks sliding layers but sliding_window is None")
        for name in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar", "sliding_rope_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be positive or None, got {value}")
        if self.sliding_rope_theta is not None and not any(w is not None for w in self.layer_windows()):
            raise ConfigError(f"sliding_rope_theta={self.sliding_rope_theta} is set but no layer has a sliding window")
        if self.experts is not None and not isinstance(self.experts, Experts):
            raise ConfigError(f"experts must be an Experts or None, got {self.experts!r}")
        match self.rope_scaling:
            case DefaultRope():
                pass
            case LinearRope(factor=f) if f > 0:
                pass
            case Llama3Rope(factor=f, low_freq_factor=lo, high_freq_factor=hi,
                            original_max_position_embeddings=orig) if f > 0 and 0 < lo < hi and orig > 0:
                pass
            case LongRope(short_factor=short) if len(short) != self.rope_dim // 2:
                raise ConfigError(f"longrope short_factor and long_factor have {len(short)} entries, expected one per "
                                  f"rotary frequency: rotary dimensions {self.rope_dim} / 2 = {self.rope_dim // 2}")
            case LongRope() | YarnRope():
                pass
            case other:
                raise ConfigError(f"invalid rope_scaling {other!r}")

    # Derived values.
    @property
    def q_per_kv(self) -> int:
        """G: query heads sharing one kv head."""
        return self.n_heads // self.n_kv_heads

    @property
    def rope_dim(self) -> int:
        """R: the dimensions of each head that RoPE rotates (``rotary_dim``, or all ``head_dim``)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def attn_scale(self) -> float:
        scalar = self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim
        return float(scalar) ** -0.5

    @property
    def param_jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    @property
    def compute_jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.compute_dtype)

    def layer_windows(self) -> tuple[int | None, ...]:
        """The sliding window of each layer (None: full causal attention)."""
        if self.sliding_window is None:
            return (None,) * self.n_layers
        flags = self.sliding_layers if self.sliding_layers is not None else (True,) * self.n_layers
        return tuple(self.sliding_window if f else None for f in flags)

    def layer_rope(self, sliding: bool) -> tuple[float, RopeScaling]:
        """(theta, scaling) of the RoPE of a layer with a sliding window (``sliding``) or of a global one."""
        if sliding and self.sliding_rope_theta is not None:
            return self.sliding_rope_theta, DefaultRope()
        return self.rope_theta, self.rope_scaling

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        D, F, V, H = self.d_model, self.d_ff, self.vocab_size, self.head_dim
        attn = D * H * (self.n_heads + 2 * self.n_kv_heads) + self.n_heads * H * D
        if self.qkv_bias:
            attn += H * (self.n_heads + 2 * self.n_kv_heads)
        qk_norms = 2 * H if self.qk_norm_scope is QKNormScope.HEAD else (self.n_heads + self.n_kv_heads) * H
        norms = D * ((4 if self.sandwich_norm else 2) - (0 if self.pre_norm else 2)) + (qk_norms if self.qk_norm else 0)
        mlp = 3 * D * F
        if self.experts is not None:  # the experts and the router; a shared expert and its gate
            shared = self.experts.shared_d_ff
            mlp = self.experts.num_experts * (3 * D * F + D) + (0 if shared is None else 3 * D * shared + D)
        per_layer = attn + mlp + norms
        head = 0 if self.tie_embeddings else V * D
        if self.classifier is not None:
            head = D * self.classifier.num_labels
        return V * D + self.n_layers * per_layer + D + head

    def check_language_model(self) -> None:
        """Refuses (:class:`NoLanguageModelHead`) a sequence classifier where token logits are needed."""
        if self.classifier is not None:
            n = self.classifier.num_labels
            raise NoLanguageModelHead(f"this model is a sequence classifier ({n} label{'s' * (n != 1)}): it has no LM "
                                      "head to generate or score tokens with; classify with llm_jax.classify")

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # Serialisation (checkpoints store the config as versioned JSON).
    def to_dict(self) -> dict[str, Any]:
        """The config as JSON values; fields added after the first checkpoints are left out while None."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _LATER_DEFAULTS and value == _LATER_DEFAULTS[field.name]:
                continue  # Llama's norms: configs read (and hash) as before these switches existed
            if isinstance(value, enum.Enum):
                value = value.value
            elif field.name == "rope_scaling":
                value = {"type": type(value).__name__, **{k: list(v) if isinstance(v, tuple) else v
                                                          for k, v in dataclasses.asdict(value).items()}}
            elif isinstance(value, tuple):
                value = list(value)
            elif field.name in _LATER_FIELDS and value is None:
                continue  # float weights, an LM head, dense MLPs, ...: configs read the same as before these existed
            elif field.name == "experts":
                value = value.to_dict()
            elif field.name in ("quantization", "classifier"):
                value = dataclasses.asdict(value)
                if field.name == "classifier":
                    value = {"labels": list(value["labels"]), "problem": value["problem"].value}
            out[field.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        data = {k: v for k, v in data.items() if k not in _RUNTIME_FIELDS}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown model config fields {unknown}; known fields: {sorted(known)}")
        rope = data.pop("rope_scaling", None)
        if rope is not None:
            rope = dict(rope)
            kinds = {c.__name__: c for c in (DefaultRope, LinearRope, Llama3Rope, LongRope, YarnRope)}
            kind = rope.pop("type", "DefaultRope")
            if kind not in kinds:
                raise ConfigError(f"unknown rope_scaling type {kind!r}; choose one of {sorted(kinds)}")
            try:
                data["rope_scaling"] = kinds[kind](**rope)
            except TypeError as e:
                raise ConfigError(f"invalid rope_scaling {kind} {rope!r}: {e}") from None
        if data.get("sliding_layers") is not None:
            data["sliding_layers"] = tuple(data["sliding_layers"])
        if data.get("quantization") is not None:
            data["quantization"] = Quantization.from_dict(data["quantization"])
        if data.get("classifier") is not None:
            data["classifier"] = Classifier(**data["classifier"])
        if data.get("experts") is not None:
            try:
                data["experts"] = Experts(**data["experts"])
            except TypeError as e:
                raise ConfigError(f"invalid experts {data['experts']!r}: {e}") from None
        return cls(**data)
