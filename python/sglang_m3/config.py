"""MiniMax-M3 configuration: one parse of the HF config, validated, frozen.

Two spellings of the same text config exist and both parse (DESIGN section 4):

* the released ``config.json``: ``sparse_attention_config{sparse_*}``,
  ``moe_layer_freq``, ``hidden_act: swigluoai``, ``scoring_func`` ...
* transformers' normalised form: ``index_*``, ``layer_types``,
  ``mlp_layer_types`` (``MiniMaxM3VLTextConfig.__post_init__`` rewrites the
  released keys into these and drops ``sparse_attention_config``).

Anything this design cannot serve is refused here, at start-up, with a
``ValueError`` that names the field and the value; nothing is silently ignored.

SGLang's CPU path pads the MoE width (``intermediate_size``) and, for uneven
tensor-parallel splits, the head counts in the config it hands to the model, keeping
the checkpoint's values as ``original_*``; those are the values parsed here (the
checkpoint's tensors have the original shapes).

``M3Config.from_hf`` is parsed once per process per distinct config (cached); every
field has one reader, here.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from typing import Any, Mapping

logger = logging.getLogger(__name__)

M3_ARCHITECTURES = ("MiniMaxM3SparseForConditionalGeneration", "MiniMaxM3SparseForCausalLM")

# transformers' layer_types values, and the released 0/1 per-layer flags mapped onto them.
_DENSE_ATTN, _SPARSE_ATTN = "full_attention", "minimax_m3_sparse"
_DENSE_MLP, _MOE_MLP = "dense", "sparse"


class M3ConfigError(ValueError):
    """A MiniMax-M3 config value this plugin refuses to serve."""


@dataclass(frozen=True)
class MSAConfig:
    """MiniMax Sparse Attention selection parameters (DESIGN section 5)."""

    index_heads: int  # one index head per KV group
    index_dim: int
    block_size: int  # == KV page size
    topk_blocks: int
    local_blocks: int


@dataclass(frozen=True)
class M3Config:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    max_position_embeddings: int
    dense_intermediate_size: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    num_experts: int
    top_k: int
    routed_scaling_factor: float
    swiglu_alpha: float
    swiglu_limit: float
    tie_word_embeddings: bool
    sparse_layers: tuple[bool, ...]  # per layer: MSA attention (else dense causal)
    moe_layers: tuple[bool, ...]  # per layer: MoE (else dense MLP)
    msa: MSAConfig

    @property
    def sparse_layer_ids(self) -> list[int]:
        return [i for i, s in enumerate(self.sparse_layers) if s]

    @property
    def dense_layer_ids(self) -> list[int]:
        return [i for i, s in enumerate(self.sparse_layers) if not s]

    @classmethod
    def from_hf(cls, hf_config: Any) -> "M3Config":
        """Parse a VL config (``text_config`` inside) or a text config, either spelling."""
        architecture = _architecture(hf_config)
        text = getattr(hf_config, "text_config", None)
        if text is None and isinstance(hf_config, Mapping):
            text = hf_config.get("text_config")
        d = _as_dict(text if text is not None else hf_config)
        return _parse_cached(json.dumps(d, sort_keys=True, default=repr), architecture)

    @classmethod
    def from_text_dict(cls, d: Mapping[str, Any], architecture: str) -> "M3Config":
        num_layers = _positive(d, "num_hidden_layers")
        sparse_layers, moe_layers, msa = _parse_layers_and_msa(d, num_layers)
        # transformers normalises the released "swigluoai" to "silu" and computes the OAI gate inline.
        _check_choice(d, "hidden_act", ("swigluoai", "silu"))
        _check_choice(d, "qk_norm_type", ("per_head",))
        _check_choice(d, "use_gemma_norm", (True,))
        _check_choice(d, "use_qk_norm", (True,))
        _check_choice(d, "scoring_func", ("sigmoid",))
        _check_choice(d, "use_routing_bias", (True,))
        _check_choice(d, "attention_output_gate", (False,))
        _check_choice(d, "n_shared_experts", (1,))
        hidden = _positive(d, "hidden_size")
        num_heads = _positive(d, "num_attention_heads", original="original_num_attention_heads")
        num_kv_heads = _positive(d, "num_key_value_heads", original="original_total_num_kv_heads")
        head_dim = _positive(d, "head_dim") if d.get("head_dim") is not None else hidden // num_heads
        rope_theta, rotary_dim = _rope(d, head_dim)
        if num_heads % num_kv_heads:
            raise M3ConfigError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        if msa.index_heads != num_kv_heads:
            raise M3ConfigError(
                f"index_n_heads (sparse_num_index_heads)={msa.index_heads} != num_key_value_heads={num_kv_heads}: "
                "MSA selects blocks per KV group, so each group needs exactly one index head"
            )
        if rotary_dim > msa.index_dim:
            raise M3ConfigError(f"rotary dims={rotary_dim} exceed index_head_dim={msa.index_dim}")
        num_experts = _positive(d, "num_local_experts")
        top_k = _positive(d, "num_experts_per_tok")
        if top_k > num_experts:
            raise M3ConfigError(f"num_experts_per_tok={top_k} exceeds num_local_experts={num_experts}")
        return cls(
            architecture=architecture,
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=_positive(d, "vocab_size"),
            rms_norm_eps=float(_req(d, "rms_norm_eps")),
            rope_theta=rope_theta,
            rotary_dim=rotary_dim,
            max_position_embeddings=_positive(d, "max_position_embeddings"),
            dense_intermediate_size=_positive(
                d, "dense_intermediate_size", original="original_dense_intermediate_size"
            ),
            moe_intermediate_size=_positive(d, "intermediate_size", original="original_intermediate_size"),
            shared_intermediate_size=_positive(
                d, "shared_intermediate_size", original="original_shared_intermediate_size"
            ),
            num_experts=num_experts,
            top_k=top_k,
            routed_scaling_factor=float(_req(d, "routed_scaling_factor")),
            swiglu_alpha=float(_req(d, "swiglu_alpha")),
            swiglu_limit=float(_req(d, "swiglu_limit")),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            sparse_layers=sparse_layers,
            moe_layers=moe_layers,
            msa=msa,
        )


@functools.lru_cache(maxsize=16)
def _parse_cached(text_json: str, architecture: str) -> M3Config:
    return M3Config.from_text_dict(json.loads(text_json), architecture)


def _draft_config_file(path: str) -> str:
    """The draft's ``config.json``: in a local directory, else fetched (or found cached) by hub id as SGLang does."""
    import os

    if os.path.isdir(path):
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise M3ConfigError(f"--speculative-draft-model-path={path!r}: no config.json there")
        return cfg_file
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo_id=path, filename="config.json")
    except Exception as err:  # noqa: BLE001  (bad id, no network and not cached, gated repo, ...)
        raise M3ConfigError(
            f"--speculative-draft-model-path={path!r}: not a local directory, and its config.json could not be "
            f"read from the Hugging Face Hub or its cache ({type(err).__name__}: {err})"
        ) from None


@dataclass(frozen=True)
class DraftConfig:
    """An EAGLE3 draft checkpoint's config (DESIGN section 7): the one reader of its fields,
    for the start-up checks, the pool geometry and the draft model alike.

    The draft's KV rows live in the target's pool (layer ids after the target's), so
    its head_dim must be the target's; its hidden size must match for the fused
    aux hidden states and the shared embedding; its vocabulary is the target's, or a
    reduced one mapped to target ids by ``d2t``.
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target vocabulary the draft predicts into
    draft_vocab_size: int  # rows of the draft's own lm_head (== vocab_size without d2t)
    rms_norm_eps: float
    rope_theta: float
    aux_layer_ids: tuple[int, ...] | None  # eagle_aux_hidden_state_layer_ids, as given (outputs)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DraftConfig":
        layers = d.get("num_hidden_layers")
        if layers != 1:
            raise M3ConfigError(f"draft num_hidden_layers={layers}: sglang-m3 serves 1-layer drafts")
        # SGLang's CPU path pads these for uneven TP splits (the draft's 2 KV heads at TP8); the
        # checkpoint's values are the ``original_*`` ones.
        heads = _positive(d, "num_attention_heads", original="original_num_attention_heads")
        kv_heads = (
            _positive(d, "num_key_value_heads", original="original_total_num_kv_heads")
            if d.get("num_key_value_heads") is not None
            else heads
        )
        if heads % kv_heads:
            raise M3ConfigError(
                f"draft num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        hidden = _positive(d, "hidden_size")
        vocab = _positive(d, "vocab_size")
        draft_vocab = _positive(d, "draft_vocab_size") if d.get("draft_vocab_size") is not None else vocab
        if draft_vocab > vocab:
            raise M3ConfigError(f"draft draft_vocab_size={draft_vocab} exceeds its vocab_size={vocab}")
        _, theta = _plain_rope(d, "draft ")
        ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=_positive(d, "head_dim") if d.get("head_dim") is not None else hidden // heads,
            intermediate_size=_positive(d, "intermediate_size", original="original_intermediate_size"),
            vocab_size=vocab,
            draft_vocab_size=draft_vocab,
            rms_norm_eps=float(_req(d, "rms_norm_eps")),
            rope_theta=float(theta),
            aux_layer_ids=None if ids is None else tuple(int(i) for i in ids),
        )

    @classmethod
    def from_hf(cls, config: Any) -> "DraftConfig":
        return cls.from_dict(_as_dict(config))

    @classmethod
    def from_path(cls, path: str, target: "M3Config") -> "DraftConfig":
        """The draft at ``path`` (directory or hub id), checked against the target it serves."""
        with open(_draft_config_file(path)) as f:
            d = json.load(f)
        arch = (d.get("architectures") or ["?"])[0]
        if arch != "LlamaForCausalLMEagle3":  # the worker renames it to our draft class afterwards
            raise M3ConfigError(f"draft architectures[0]={arch!r}: sglang-m3 serves LlamaForCausalLMEagle3 drafts")
        draft = cls.from_dict(d)
        draft.check_fits(target)
        return draft

    def check_fits(self, target: "M3Config") -> None:
        for field, value, want in (
            ("head_dim", self.head_dim, target.head_dim),
            ("hidden_size", self.hidden_size, target.hidden_size),
            ("vocab_size", self.vocab_size, target.vocab_size),
        ):
            if value != want:
                raise M3ConfigError(f"draft {field}={value}: must equal the target's {want}")
        # Refuse aux layer ids the target does not have (SGLang hands them to the target model).
        aux_capture_inputs(self.aux_layer_ids, target.num_layers)


def aux_capture_inputs(layer_ids, num_layers: int) -> tuple[int, ...]:
    """Target layers whose *input* EAGLE3 captures, in the draft's order.

    The draft config names layer *outputs* ``l`` (default ``(2, N // 2, N - 3)``); the
    output of layer ``l`` is the input of layer ``l + 1``: output -1 is the embeddings,
    output ``N - 1`` the final pre-norm hidden state (index ``N``). Released M3 (N = 60):
    (3, 31, 58). An off-by-one here silently costs acceptance (DESIGN section 7).
    """
    outputs = (2, num_layers // 2, num_layers - 3) if layer_ids is None else tuple(int(i) for i in layer_ids)
    bad = [i for i in outputs if not -1 <= i < num_layers]
    if bad:
        raise M3ConfigError(f"eagle_aux_hidden_state_layer_ids {bad}: outputs of layers -1..{num_layers - 1} only")
    return tuple(i + 1 for i in outputs)


def is_m3_config(hf_config: Any) -> bool:
    try:
        return _architecture(hf_config) in M3_ARCHITECTURES
    except M3ConfigError:
        return False


def check_page_size(page_size: int | None, msa: MSAConfig) -> int:
    """The KV page must be one MSA block; returns the page size to use."""
    if page_size is None:
        return msa.block_size
    if page_size != msa.block_size:
        raise M3ConfigError(
            f"page_size={page_size} conflicts with the checkpoint's index block size "
            f"(sparse_block_size / index_block_size)={msa.block_size}: MiniMax-M3 needs "
            f"page_size == block size; omit --page-size or pass {msa.block_size}"
        )
    return page_size


# ----------------------------------------------------------------------------- helpers


def _as_dict(cfg: Any) -> dict:
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if hasattr(cfg, "to_dict"):
        d = cfg.to_dict()
        # to_dict() of a config built from unknown keys keeps them; attributes set
        # after construction (transformers' __post_init__) are also in __dict__.
        d.update({k: v for k, v in vars(cfg).items() if not k.startswith("_")})
        return d
    raise M3ConfigError(f"cannot read a MiniMax-M3 config from {type(cfg).__name__}")


def _architecture(cfg: Any) -> str:
    archs = cfg.get("architectures") if isinstance(cfg, Mapping) else getattr(cfg, "architectures", None)
    if not archs:
        raise M3ConfigError("config has no 'architectures' entry")
    return archs[0]


def _req(d: Mapping[str, Any], key: str):
    if key not in d or d[key] is None:
        raise M3ConfigError(f"MiniMax-M3 config is missing required field {key!r}")
    return d[key]


def _check_choice(d: Mapping[str, Any], key: str, allowed: tuple) -> None:
    if key in d and d[key] is not None and d[key] not in allowed:
        raise M3ConfigError(f"unsupported {key}={d[key]!r}; supported: {list(allowed)}")


def _positive(d: Mapping[str, Any], key: str, original: str | None = None) -> int:
    """A required positive integer; ``original``: the key under which SGLang keeps the checkpoint's value
    when it pads ``key`` (CPU path)."""
    name = original if original and d.get(original) is not None else key
    value = _req(d, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise M3ConfigError(f"{name}={value!r}: must be a positive integer")
    return value


def _plain_rope(d: Mapping[str, Any], what: str) -> tuple[dict, Any]:
    """The RoPE dict (``rope_scaling`` or ``rope_parameters``) and ``rope_theta`` (the dict's, else the top
    level's) of a config; a RoPE type other than plain is refused (``what`` names the config)."""
    params = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    field = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise M3ConfigError(f"{what}config: unsupported {field}.rope_type={rope_type!r}; supported: ['default']")
    theta = params.get("rope_theta", d.get("rope_theta"))
    if theta is None:
        raise M3ConfigError(f"{what}config is missing required field 'rope_theta'")
    return params, theta


def _rope(d: Mapping[str, Any], head_dim: int) -> tuple[float, int]:
    """``(rope_theta, rotary dims)`` by transformers' rule (``PreTrainedConfig.convert_rope_params_to_dict``):
    the released ``rope_scaling`` or ``rope_parameters`` dict, ``rope_theta`` / ``partial_rotary_factor``
    from the top level where given; ``head_dim * partial_rotary_factor`` dims rotate (factor 1.0 when
    absent). transformers ignores ``rotary_dim``, and so do we (a warning says when it disagrees)."""
    params, theta = _plain_rope(d, "MiniMax-M3 ")
    factor = d.get("partial_rotary_factor")
    factor = params.get("partial_rotary_factor", 1.0) if factor is None else factor
    if not 0 < float(factor) <= 1:
        raise M3ConfigError(f"partial_rotary_factor={factor!r}: must be in (0, 1]")
    rotary = int(head_dim * float(factor))
    if rotary % 2:
        raise M3ConfigError(
            f"head_dim={head_dim} x partial_rotary_factor={factor} = {rotary} rotary dims: must be even"
        )
    if d.get("rotary_dim") is not None and int(d["rotary_dim"]) != rotary:
        logger.warning(
            "sglang-m3: rotary_dim=%s disagrees with head_dim=%d x partial_rotary_factor=%s = %d; rotating %d "
            "dims as transformers does (it ignores rotary_dim)",
            d["rotary_dim"],
            head_dim,
            factor,
            rotary,
            rotary,
        )
    return float(theta), rotary


def _per_layer(values, num_layers: int, field: str, mapping: Mapping[Any, bool]) -> tuple[bool, ...]:
    if len(values) != num_layers:
        raise M3ConfigError(f"{field} has {len(values)} entries, expected num_hidden_layers={num_layers}")
    out = []
    for i, v in enumerate(values):
        if v not in mapping:
            raise M3ConfigError(f"unknown layer type {field}[{i}]={v!r}; supported: {list(mapping)}")
        out.append(mapping[v])
    return tuple(out)


def _parse_layers_and_msa(d: Mapping[str, Any], num_layers: int):
    sparse_cfg = d.get("sparse_attention_config")
    if sparse_cfg:  # released spelling
        if sparse_cfg.get("use_sparse_attention") is False:
            raise M3ConfigError("sparse_attention_config.use_sparse_attention=False is not a MiniMax-M3 MSA model")
        score = _req(sparse_cfg, "sparse_score_type")
        if score != "max":
            raise M3ConfigError(f"unsupported sparse_attention_config.sparse_score_type={score!r}; supported: ['max']")
        init_block = _req(sparse_cfg, "sparse_init_block")
        if init_block != 0:
            raise M3ConfigError(f"unsupported sparse_attention_config.sparse_init_block={init_block!r}; supported: [0]")
        sparse_layers = _per_layer(
            _req(sparse_cfg, "sparse_attention_freq"), num_layers, "sparse_attention_freq", {0: False, 1: True}
        )
        # The released MSA layers have no index value/output path; a sparse layer that asks for one
        # (flag 0) is an architecture this plugin does not implement.
        no_index_value = sparse_cfg.get("sparse_disable_index_value")
        if no_index_value is not None:
            flags = _per_layer(no_index_value, num_layers, "sparse_disable_index_value", {0: False, 1: True})
            for i, (sparse, disabled) in enumerate(zip(sparse_layers, flags)):
                if sparse and not disabled:
                    raise M3ConfigError(
                        f"unsupported sparse_attention_config.sparse_disable_index_value[{i}]=0 on sparse layer {i}: "
                        "sglang-m3 implements MSA without an index value path (supported: 1)"
                    )
        msa = MSAConfig(
            index_heads=_req(sparse_cfg, "sparse_num_index_heads"),
            index_dim=_req(sparse_cfg, "sparse_index_dim"),
            block_size=_req(sparse_cfg, "sparse_block_size"),
            topk_blocks=_req(sparse_cfg, "sparse_topk_blocks"),
            local_blocks=_req(sparse_cfg, "sparse_local_block"),
        )
    else:  # transformers' normalised spelling
        sparse_layers = _per_layer(
            _req(d, "layer_types"), num_layers, "layer_types", {_DENSE_ATTN: False, _SPARSE_ATTN: True}
        )
        msa = MSAConfig(
            index_heads=_req(d, "index_n_heads"),
            index_dim=_req(d, "index_head_dim"),
            block_size=_req(d, "index_block_size"),
            topk_blocks=_req(d, "index_topk_blocks"),
            local_blocks=_req(d, "index_local_blocks"),
        )
    if d.get("moe_layer_freq") is not None:
        moe_layers = _per_layer(d["moe_layer_freq"], num_layers, "moe_layer_freq", {0: False, 1: True})
    else:
        moe_layers = _per_layer(
            _req(d, "mlp_layer_types"), num_layers, "mlp_layer_types", {_DENSE_MLP: False, _MOE_MLP: True}
        )
    for name, value in (("block_size", msa.block_size), ("topk_blocks", msa.topk_blocks), ("index_dim", msa.index_dim)):
        if value <= 0:
            raise M3ConfigError(f"MSA {name}={value} must be positive")
    if not 0 <= msa.local_blocks <= msa.topk_blocks:
        raise M3ConfigError(f"MSA local_blocks={msa.local_blocks} must be in [0, topk_blocks={msa.topk_blocks}]")
    return sparse_layers, moe_layers, msa
