"""Upstream's ``model.backend`` (NeMo AutoModel's ``BackendConfig``): which kernels a model runs, here.

Upstream reads it in its own model implementations (Transformer Engine layers, DeepEP dispatchers, grouped-GEMM
experts, fused RoPE ...). automodel trains Hugging Face models, so each setting either names what a Hugging Face
model runs (it acts: ``attn`` selects ``attn_implementation``, ``rms_norm: torch`` the RMSNorm arithmetic;
``fake_balanced_gate: true`` replaces the router's choice in the model's experts modules, ``gate_precision`` the
dtype its routers compute in; ``linear: torch`` and the others are what the model is) or is refused at validation
with the reason. Nothing is imported here: validation checks a config without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# setting -> the values that act here (None: not set)
ATTENTION = {"sdpa": "sdpa", "eager": "eager", "flex": "flex_attention"}  # upstream name -> attn_implementation
# gate_precision's names (upstream's, with or without "torch.", any case; and fp32 / fp16 as elsewhere here) -> dtype
GATE_DTYPES = {"float32": "float32", "float": "float32", "fp32": "float32", "bfloat16": "bfloat16",
               "bf16": "bfloat16", "float16": "float16", "half": "float16", "fp16": "float16", "float64": "float64",
               "double": "float64"}
ACTS: dict[str, tuple[Any, ...]] = {
    "attn": tuple(ATTENTION),
    "linear": ("torch",),  # torch.nn.Linear: what a Hugging Face model is built from
    "rms_norm": ("torch_fp32", "torch"),  # Hugging Face's float32 RMSNorm; torch: in the input dtype (rms_norm.py)
    "rope": ("torch",),
    "rope_fusion": (False,),
    "experts": ("torch",),  # a Hugging Face MoE block's own expert loop
    "dispatcher": ("torch",),  # torch collectives (all-gather / reduce-scatter) under expert parallelism
    "dispatcher_num_sms": (20,),
    "dispatcher_share_token_dispatcher": (True,),
    "dispatcher_async_dispatch": (False,),
    "mok": (None,),
    "enable_deepep": (None,),
    "fake_balanced_gate": (False, True),  # true: balanced routing in a Hugging Face MoE model's experts
    "fake_gate_noise": (0, 0.0),
    # a Hugging Face model has no state-dict adapter: its own layout, which checkpoints keep, is the HF layout
    "enable_hf_state_dict_adapter": (True, False),
    "enable_fsdp_optimizations": (False, True),  # true: FSDP2 keeps parameters gathered between micro-batches
    "te_fp8": (None,),
    "gate_precision": (None, *GATE_DTYPES),  # the routers of a Hugging Face MoE model compute in it
    "compile_attn": (False, True),  # true: each attention module compiled (the compile slot)
    "cuda_graph": (None,),
}


def _needs_cuda(library: str, instead: str) -> str:
    return (f"needs CUDA and {library}, which this machine lacks, and upstream's own model code, which automodel "
            f"does not include (it trains Hugging Face models); {instead}")


# why a value outside ACTS cannot act here ({value} is the value as written)
REASONS = {
    "attn": _needs_cuda("its attention kernels (Transformer Engine, TileLang, cuDNN or MagiAttention)",
                        "Hugging Face models here run attn sdpa, eager or flex"),
    "linear": _needs_cuda("Transformer Engine or QuACK", "use torch"),
    "rms_norm": _needs_cuda("Transformer Engine or QuACK", "use torch_fp32"),
    "rope": _needs_cuda("QuACK", "use torch"),
    "rope_fusion": _needs_cuda("Transformer Engine", "use false (upstream itself turns fused RoPE off at present)"),
    "experts": _needs_cuda("grouped-GEMM kernels (Transformer Engine, grouped_gemm, torch._grouped_mm)",
                           "use torch"),
    "dispatcher": _needs_cuda("its communication library (DeepEP, HybridEP, UCCL-EP or MoK)", "use torch"),
    "dispatcher_num_sms": "sets the CUDA MoE dispatchers (DeepEP, HybridEP, UCCL-EP, MoK); dispatcher torch, the "
                          "one here, has no such setting: remove it",
    "dispatcher_share_token_dispatcher": "sets the CUDA MoE dispatchers; dispatcher torch, the one here, has no such "
                                         "setting: remove it",
    "dispatcher_async_dispatch": "sets the CUDA MoE dispatchers; dispatcher torch, the one here, has no such "
                                 "setting: remove it",
    "mok": "sets the Mixture-of-Kittens dispatcher, which needs CUDA: remove it",
    "enable_deepep": "was removed upstream (it warns and ignores it): set dispatcher and experts instead",
    "fake_balanced_gate": "must be true (balanced routing in a Hugging Face MoE model's experts) or false",
    "fake_gate_noise": "perturbs upstream's balanced routing with random draws; here fake_balanced_gate routes "
                       "exactly balanced (noise 0): remove it or use 0",
    "enable_hf_state_dict_adapter": "must be true or false (a Hugging Face model's own layout is the Hugging Face "
                                    "layout either way)",
    "enable_fsdp_optimizations": "must be true (FSDP2 keeps the gathered parameters and the gradient sync until a "
                                 "step's last micro-batch) or false",
    "te_fp8": _needs_cuda("Transformer Engine", "automodel's FP8 is the fp8: section (torchao)"),
    "gate_precision": f"is not a floating dtype for the router's logits; use one of {', '.join(GATE_DTYPES)} "
                      "(torch.float32 and the like too), or remove it",
    "compile_attn": "must be true (each transformer block's attention module compiled, fullgraph) or false",
    "cuda_graph": "captures CUDA graphs, which need CUDA (not on this machine): remove it",
}


def _written(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)


def backend_issues(settings: Mapping[str, Any]) -> dict[str, str]:
    """The settings that cannot act here, each with why; an unknown name when ``settings`` is a plain mapping (a
    ``_target_`` node's names are checked against BackendConfig's signature)."""
    issues = {}
    for name, value in settings.items():
        if name not in ACTS:
            issues[name] = f"not a BackendConfig setting (it has: {', '.join(ACTS)})"
        elif name == "gate_precision" and _gate_dtype_name(value) in ACTS[name]:
            continue
        elif value is not None and value not in ACTS[name]:
            issues[name] = f"{_written(value)} {REASONS[name]}"
        elif name == "attn" and value == "flex" and not has_cuda():
            issues[name] = ("'flex' needs CUDA to train: torch's FlexAttention has no backward pass on a CPU (not on "
                            "this machine); use sdpa or eager")
    return issues


def _gate_dtype_name(value: Any) -> str | None:
    """``torch.float32`` / ``FP32`` / a torch dtype -> ``float32`` and the like (None when not a name or dtype)."""
    return str(value).strip().lower().removeprefix("torch.") if value is not None else None


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class BackendConfig:
    """``model.backend``: upstream's kernel selection, each setting what a Hugging Face model runs (None: not set).
    ``attn`` changes what is built (the model's ``attn_implementation``), ``fake_balanced_gate`` how its experts
    are routed (:func:`apply_to_model`), ``gate_precision`` the dtype its routers compute in,
    ``enable_fsdp_optimizations`` what FSDP2 does between micro-batches (the
    training loop reads it with :func:`backend_setting`), ``compile_attn`` whether the compile slot compiles each
    attention module; the other accepted values are what a Hugging Face model
    is, and every other value is refused at validation (:data:`REASONS`)."""

    attn: str | None = None
    linear: str | None = None
    rms_norm: str | None = None
    rope: str | None = None
    rope_fusion: bool | None = None
    experts: str | None = None
    dispatcher: str | None = None
    dispatcher_num_sms: int | None = None
    dispatcher_share_token_dispatcher: bool | None = None
    dispatcher_async_dispatch: bool | None = None
    mok: Any = None
    enable_deepep: bool | None = None
    fake_balanced_gate: bool | None = None
    fake_gate_noise: float | None = None
    enable_hf_state_dict_adapter: bool | None = None
    enable_fsdp_optimizations: bool | None = None
    te_fp8: Any = None
    gate_precision: Any = None
    compile_attn: bool | None = None
    cuda_graph: Any = None

    def __post_init__(self) -> None:
        issues = backend_issues(vars(self))
        if issues:
            raise ValueError("; ".join(f"{name}: {message}" for name, message in issues.items()))

    @staticmethod
    def automodel_config_issues(kwargs: Mapping[str, Any]) -> dict[str, str]:
        """Validation's check of a ``{_target_: BackendConfig, ...}`` node (nothing is built)."""
        return backend_issues(kwargs)

    @property
    def attn_implementation(self) -> str | None:
        return ATTENTION.get(self.attn) if self.attn is not None else None


def backend_setting(model_section: Any, name: str) -> Any:
    """The value of setting ``name`` in a model section's ``backend`` (a mapping, a config node or a
    BackendConfig; None when unset): for the engine's parts that act on a setting after the model is built."""
    backend = model_section.get("backend") if model_section is not None else None
    if backend is not None and hasattr(backend, "to_dict"):
        backend = backend.to_dict()
    return _settings(backend).get(name)


def _settings(backend: Any) -> Mapping[str, Any]:
    if isinstance(backend, BackendConfig):
        return vars(backend)
    if isinstance(backend, Mapping):
        return {k: v for k, v in backend.items() if k != "_target_"}
    return {}


def attention_issue(value: Any) -> str | None:
    """Why an ``attn_implementation`` cannot run here (None: it can)."""
    if value is None or value in ("sdpa", "eager"):
        return None
    if value == "flex_attention":
        return None if has_cuda() else ("'flex_attention' needs CUDA to train: torch's FlexAttention has no backward "
                                        "pass on a CPU (not on this machine); use sdpa or eager")
    if str(value).startswith("flash_attention") or value in ("te", "ffpa", "magi"):
        return (f"'{value}' needs a CUDA GPU and its kernels (the flash-attn package, Transformer Engine, FFPA's CuTe "
                "kernels or MagiAttention), which this machine lacks; use sdpa or eager")
    return f"'{value}' is not an attention implementation here; use one of {', '.join(ATTENTION.values())}"


def asked_attention(kwargs: Mapping[str, Any]) -> tuple[str, str] | None:
    """(the key, the ``attn_implementation``) a model node asks for: ``attn_implementation`` itself, else the one
    its ``backend.attn`` selects; None when it asks for none (transformers then picks one the model has)."""
    if kwargs.get("attn_implementation") is not None:
        return "attn_implementation", str(kwargs["attn_implementation"])
    attn = ATTENTION.get(_settings(kwargs.get("backend")).get("attn"))
    return ("backend.attn", attn) if attn is not None else None


def attention_support_issue(model_class: Any, implementation: str) -> str | None:
    """Why ``model_class`` (a transformers model class) cannot be built with ``implementation`` (None: it can):
    transformers marks a class without an SDPA or FlexAttention path (GPT-OSS's attention sinks, Gemma 2's logit
    soft-capping) and refuses that attention when it builds one."""
    flag = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}.get(implementation)
    if flag is None or getattr(model_class, flag, True) is not False:
        return None
    return (f"'{implementation}': {model_class.__name__} has no {implementation} attention in transformers, which "
            "refuses it when building the model; use eager")


def model_backend_issues(kwargs: Mapping[str, Any], composite: bool = False) -> dict[str, str]:
    """Validation's check of a model node's ``backend`` (a plain mapping is checked here; a ``_target_`` node by
    BackendConfig's own check) against the node's other keys: the attention it selects must agree with an explicit
    ``attn_implementation`` (one that cannot run here is refused for that by the model's own check, which says
    what to use instead), unless the factory builds ``composite`` models (a language model beside vision or audio
    towers): there, as upstream, ``backend.attn`` is the language model's attention and ``attn_implementation``
    the towers' (:func:`attention_split`)."""
    backend = kwargs.get("backend")
    if backend is None:
        return {}
    settings = _settings(backend)
    issues = {} if isinstance(backend, Mapping) and "_target_" in backend else \
        {f"backend.{k}": m for k, m in backend_issues(settings).items()}
    split = attention_split(kwargs)
    if split is not None and attention_issue(split[1]) is None and not composite:
        issues["backend.attn"] = (f"{settings['attn']!r} selects attn_implementation {split[0]!r}, but the model also "
                                  f"says attn_implementation: {split[1]!r}: give one of them")
    return issues


def apply_backend(kwargs: dict[str, Any]) -> BackendConfig | None:
    """Take ``backend`` out of a model factory's keyword arguments and return it; the attention it selects becomes
    ``attn_implementation`` (pass the built model to :func:`apply_to_model` for the rest)."""
    backend = kwargs.pop("backend", None)
    if backend is None:
        return None
    if not isinstance(backend, BackendConfig):
        backend = BackendConfig(**_settings(backend))
    if backend.attn_implementation is not None:
        kwargs.setdefault("attn_implementation", backend.attn_implementation)
    return backend


def attention_split(model: Mapping[str, Any]) -> tuple[str, str] | None:
    """(the language model's, the rest's) attention where a model node's ``backend.attn`` selects another
    attention than its ``attn_implementation`` gives (None: they agree, or one is not given). Upstream runs its
    own language models with ``backend`` and builds the Hugging Face vision and audio towers with
    ``attn_implementation``; for a composite model that is what both mean here (:func:`use_language_model_attention`,
    elsewhere validation refuses the pair)."""
    selected = ATTENTION.get(_settings(model.get("backend")).get("attn"))
    explicit = model.get("attn_implementation")
    return (selected, explicit) if selected is not None and explicit is not None and explicit != selected else None


def attention_split_note(model: Mapping[str, Any] | None) -> str | None:
    """The run-start note of a composite model's two attentions (:func:`attention_split`)."""
    split = attention_split(model) if model is not None else None
    if split is None:
        return None
    return (f"note: model.backend.attn makes {split[0]!r} the language model's attention, attn_implementation "
            f"{split[1]!r} the rest of the model's (its vision and audio towers), as upstream builds them")


def use_language_model_attention(model: Any, implementation: str) -> None:
    """Switch the language model (the ``text_config`` sub-model) of a built composite model to ``implementation``,
    its other parts keeping theirs; a model without a ``text_config`` has one attention for all: refused."""
    from automodel.errors import AutomodelError

    config = model.config
    if "text_config" not in getattr(config, "sub_configs", {}) or getattr(config, "text_config", None) is None:
        raise AutomodelError(f"model.backend.attn selects attn_implementation {implementation!r} and the model also "
                             f"says attn_implementation: {config._attn_implementation!r}, but {type(model).__name__} "
                             "has no language model apart from the rest (no text_config) to give it: give one of them")
    model.set_attn_implementation({"text_config": implementation})
    if config.get_text_config()._attn_implementation != implementation:
        raise AutomodelError(f"model.backend.attn: {type(model).__name__}'s language model cannot be switched to "
                             f"attn_implementation {implementation!r}; give one attention for the whole model")


def apply_to_model(model: Any, backend: BackendConfig | None) -> Any:
    """What ``backend`` changes in a built model: ``rms_norm: torch`` makes its RMSNorms compute in the input's dtype
    (:mod:`automodel.rms_norm`); ``fake_balanced_gate: true`` (upstream's benchmarking gate)
    replaces the router's top-k choice in every experts module with fused expert parameters (transformers' MoE
    layout): token ``t``'s ``k`` slots go to experts ``t*k .. t*k+k-1`` modulo the number of experts, each with weight
    ``1/k``, so every expert gets the same load. The router still runs, its weights get zero gradients.
    ``gate_precision`` makes every router compute its logits in that dtype (:mod:`automodel.gate_precision`)."""
    if backend is not None and backend.rms_norm == "torch":
        from automodel.rms_norm import use_input_dtype_rms_norm

        use_input_dtype_rms_norm(model)
    if backend is not None and backend.gate_precision is not None:
        import torch

        from automodel.gate_precision import use_gate_precision

        use_gate_precision(model, getattr(torch, GATE_DTYPES[_gate_dtype_name(backend.gate_precision)]))
    if backend is None or not backend.fake_balanced_gate:
        return model
    from automodel.fused_experts import experts_modules

    experts = [m for _, m in experts_modules(model) if isinstance(getattr(m, "num_experts", None), int)]
    if not experts:
        from automodel.errors import AutomodelError

        raise AutomodelError(f"model.backend.fake_balanced_gate: true routes the experts of a mixture-of-experts "
                             f"model, and {type(model).__name__} has no experts module with fused gate_up_proj / "
                             "down_proj parameters (transformers' MoE layout); use false")
    for module in experts:
        module.register_forward_pre_hook(_balanced_routing)
    return model


def _balanced_routing(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """An experts module's forward pre-hook: its ``(hidden_states, top_k_index, top_k_weights)`` with the top-k
    choice replaced by the balanced one (:func:`apply_to_model`)."""
    import torch

    hidden_states, index, weights, *rest = args
    tokens, k = index.shape
    balanced = torch.arange(tokens * k, device=index.device).view(tokens, k) % module.num_experts
    uniform = torch.full_like(weights, 1.0 / k) + 0.0 * weights  # keeps the router in the graph: zero gradients
    return (hidden_states, balanced.to(index.dtype), uniform, *rest)
