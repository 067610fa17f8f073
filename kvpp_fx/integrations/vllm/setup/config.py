"""KVPP configuration and deployment validation, as the vLLM plugin applies them.

`KVPPConfig` is read from vLLM-style ``additional_config`` (``{"enable_kvpp": true}``). The KVPP group
is the TP x PCP group of a pipeline stage; a group of size 1 means KVPP is off.

`KVPPConfig.validate` checks a deployment before anything is allocated and raises `ValueError` with the
reference implementation's messages, in the reference implementation's order. A deployment can be
given as a `Deployment`, a plain dict with the same field names, or a ``vllm_config``-like object whose
attributes are read when present.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pydantic

# Defined with the cost model that chooses between them (the runtime imports it): import them from there.
from kvpp_fx.cache.cost import KVPP_MODES, Mode
# Shared with the core's backend, which refuses mode="full" with it.
from kvpp_fx.schedule import MSG_GRAPH_MODE

# vllm-ascend's KVPP-aware PD connector: the only one that knows which rank owns a layer.
SUPPORTED_CONNECTOR = "MooncakeConnectorV2"
# vLLM 0.32's own KV connectors (vllm.distributed.kv_transfer.kv_connector.factory). Each reads every
# layer's cache on every rank, and under KVPP a rank holds only its own layers (the rest are scratch
# buffers), so they run with KVPP only through a KVPP subclass that reads each layer on its owner
# (`kvpp_fx.integrations.vllm.connectors`), which exists for those in KVPP_VLLM_CONNECTORS.
VLLM_CONNECTORS = (
    "ExampleConnector", "ExampleHiddenStatesConnector", "LMCacheConnectorV1", "LMCacheMPConnector",
    "NixlConnector", "NixlPullConnector", "NixlPushConnector", "MultiConnector", "HiSparseConnector",
    "MoRIIOConnector", "OffloadingConnector", "DecodeBenchConnector", "MooncakeConnector",
    "MooncakeStoreConnector", "FlexKVConnectorV1", "SimpleCPUOffloadConnector", "HF3FSKVConnector",
)
# vLLM's connectors that run on a KVPP prefill node (kv_role "kv_producer"): each layer leaves the
# instance from its owner (NixlConnector is vLLM's name of NixlPullConnector).
KVPP_VLLM_CONNECTORS = ("ExampleConnector", "NixlConnector", "NixlPullConnector", "MooncakeConnector")
# The module that names KVPP's subclasses of them (defined in kv_connectors/): the plugin names it in
# kv_transfer_config's kv_connector_module_path, so vLLM's connector factory builds KVPP's class under
# vLLM's own name.
KVPP_CONNECTOR_MODULE = "kvpp_fx.integrations.vllm.connectors"
SUPPORTED_SPEC_METHODS = (None, "mtp", "dspark")
GRAPH_MODES = ("eager", "piecewise", "full")
MODEL_KINDS = ("mla", "sfa", "hybrid", "mha")
KV_ROLES = (None, "kv_producer", "kv_consumer", "kv_both")

MSG_DCP = "KVPP and DCP cannot be enabled at the same time."
MSG_CONNECTOR = "KVPP broadcast supports only MooncakeConnectorV2 for PD disaggregation."
MSG_VLLM_CONNECTOR = (
    "KVPP cannot run with vLLM's KV connector {name}: it reads every layer's KV cache on every rank, "
    "while under KVPP a rank keeps only the layers it owns. With KVPP on a prefill node (kv_role "
    "'kv_producer') use " + ", ".join(KVPP_VLLM_CONNECTORS) + " (each layer leaves from its owner), or "
    "vllm-ascend's MooncakeConnectorV2; or remove kv_transfer_config."
)
MSG_NOT_KVPP_CONNECTOR = (
    "kv_transfer_config names connector {name} in module {module}, which is not a KVPP connector (a "
    "subclass of a class in " + KVPP_CONNECTOR_MODULE + "): with KVPP on, a rank's non-owned layers are "
    "scratch slots, which a connector must not read. Use one of " + ", ".join(KVPP_VLLM_CONNECTORS) +
    " without kv_connector_module_path, or run without additional_config.enable_kvpp."
)
MSG_DECODE_NODE = "KVPP must be disabled on the decode-only node."
MSG_NIXL_PARALLEL = (
    "KVPP with vLLM's {name} runs on a prefill instance of TP ranks only: KVPP's connector finds each "
    "layer's owner among the prefill instance's TP ranks, so the layers of PCP or PP ranks other than the "
    "first would never be sent. Set prefill_context_parallel_size=1 and pipeline_parallel_size=1, or run without "
    "additional_config.enable_kvpp."
)
MSG_PRODUCER_ONLY = (
    MSG_DECODE_NODE + " With vLLM's {name}, KVPP runs only on a prefill node: set kv_role='kv_producer' "
    "(a 'kv_both' node also loads KV the way a decode node does), or run without "
    "additional_config.enable_kvpp."
)
MSG_MODEL_KIND = "KVPP currently supports only non-hybrid MLA models."
MSG_SPEC_METHOD = (
    "KVPP currently supports speculative decoding only with method='mtp' or method='dspark'."
)
MSG_ADAPTIVE = "KVPP does not support DSpark adaptive verification."
MSG_SPEC_TOKENS = "KVPP currently supports only a fixed number of speculative tokens."

_LAX_BOOL = pydantic.TypeAdapter(bool)

# ``kvpp_fx`` is written by the vLLM plugin itself (the compile digest and the inner backend).
KNOWN_KEYS = ("enable_kvpp", "kvpp_mode", "kvpp_scratch_blocks", "kvpp_fx")
USER_KEYS = KNOWN_KEYS[:-1]


def parse_enable_kvpp(value: Any) -> bool:
    """Parse ``additional_config.enable_kvpp`` with pydantic's lax bool rules."""
    try:
        return _LAX_BOOL.validate_python(value)
    except pydantic.ValidationError:
        raise ValueError(
            f"additional_config.enable_kvpp must be a boolean, got {value!r}."
        ) from None


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return value


@dataclass(frozen=True)
class Deployment:
    """What validation needs to know about a deployment (plain data; no torch)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    pcp: int = 1
    dcp: int = 1
    graph_mode: str = "eager"
    model_kind: str = "mla"
    spec_method: str | None = None
    spec_tokens_fixed: bool = True
    adaptive_verification: bool = False
    kv_connector: str | None = None
    kv_role: str | None = None
    # kv_transfer_config.kv_connector_module_path: where set, the connector class is not vLLM's own
    # and the vLLM integration checks it is KVPP's (`kv_connectors.routing.route_connector`).
    kv_connector_module_path: str | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "pcp", "dcp"):
            _positive_int(name, getattr(self, name))
        if self.graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode must be one of {GRAPH_MODES}, got {self.graph_mode!r}.")
        if self.model_kind not in MODEL_KINDS:
            raise ValueError(f"model_kind must be one of {MODEL_KINDS}, got {self.model_kind!r}.")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}.")

    @classmethod
    def from_any(cls, source: Any) -> Deployment:
        """A `Deployment`, a dict of its fields, or a ``vllm_config``-like object."""
        if isinstance(source, Deployment):
            return source
        if isinstance(source, Mapping):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(source) - known)
            if unknown:
                raise ValueError(f"unknown deployment fields: {', '.join(unknown)}.")
            return cls(**source)
        return cls.from_vllm_config(source)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> Deployment:
        """Read a deployment from an object shaped like vLLM's ``VllmConfig``.

        Each field is read by attribute when present; a missing attribute keeps the default.
        """
        parallel = getattr(vllm_config, "parallel_config", None)
        fields: dict[str, Any] = {}
        for name, attr in (
            ("tp", "tensor_parallel_size"),
            ("pp", "pipeline_parallel_size"),
            ("dp", "data_parallel_size"),
            ("pcp", "prefill_context_parallel_size"),
            ("dcp", "decode_context_parallel_size"),
        ):
            value = getattr(parallel, attr, None)
            if value is not None:
                fields[name] = int(value)
        fields["graph_mode"] = _graph_mode_of(vllm_config)
        fields["model_kind"] = model_kind_of(getattr(vllm_config, "model_config", None))
        spec = getattr(vllm_config, "speculative_config", None)
        if spec is not None:
            # vLLM's names: SpeculativeConfig.method, .num_speculative_tokens_per_batch_size (a
            # per-batch-size schedule, which `uses_dynamic_speculative_decoding()` reports) and
            # .enable_adaptive_verification.
            fields["spec_method"] = _spec_method_of(getattr(spec, "method", None))
            dynamic = getattr(spec, "uses_dynamic_speculative_decoding", None)
            dynamic = dynamic() if callable(dynamic) else (
                getattr(spec, "num_speculative_tokens_per_batch_size", None) is not None)
            fields["spec_tokens_fixed"] = not dynamic
            fields["adaptive_verification"] = bool(getattr(spec, "enable_adaptive_verification", False))
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        if transfer is not None:
            fields["kv_connector"] = getattr(transfer, "kv_connector", None)
            fields["kv_role"] = getattr(transfer, "kv_role", None)
            fields["kv_connector_module_path"] = getattr(transfer, "kv_connector_module_path", None)
        return cls(**fields)


def check_connector(d: Deployment) -> None:
    """The PD rule: vllm-ascend's MooncakeConnectorV2 as the seed allows it, or one of vLLM's connectors
    KVPP has a subclass for, on a prefill node. A connector class from a module path is the vLLM
    integration's to check; a name alone is checked here."""
    if d.kv_connector_module_path is None:
        if d.kv_connector in VLLM_CONNECTORS and d.kv_connector not in KVPP_VLLM_CONNECTORS:
            raise ValueError(MSG_VLLM_CONNECTOR.format(name=d.kv_connector))
        if d.kv_connector not in VLLM_CONNECTORS and d.kv_connector != SUPPORTED_CONNECTOR:
            raise ValueError(MSG_CONNECTOR)
    if d.kv_role == "kv_consumer":
        raise ValueError(MSG_DECODE_NODE)
    if d.kv_connector != SUPPORTED_CONNECTOR and d.kv_role != "kv_producer":
        raise ValueError(MSG_PRODUCER_ONLY.format(name=d.kv_connector))
    if d.kv_connector in ("NixlConnector", "NixlPullConnector", "MooncakeConnector") and (d.pcp > 1 or d.pp > 1):
        raise ValueError(MSG_NIXL_PARALLEL.format(name=d.kv_connector))


def _graph_mode_of(vllm_config: Any) -> str:
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "enforce_eager", False):
        return "eager"
    compilation = getattr(vllm_config, "compilation_config", None)
    cudagraph_mode = getattr(compilation, "cudagraph_mode", None)
    if cudagraph_mode is None:
        return "eager"
    name = str(getattr(cudagraph_mode, "name", cudagraph_mode)).upper()
    if "FULL" in name:
        return "full"
    if "PIECEWISE" in name:
        return "piecewise"
    return "eager"


def model_kind_of(model_config: Any) -> str:
    if model_config is None:
        return "mla"
    if getattr(model_config, "is_hybrid", False):
        return "hybrid"
    if not getattr(model_config, "use_mla", True):
        return "mha"
    hf_config = getattr(model_config, "hf_config", None)
    if hf_config is not None and getattr(hf_config, "index_topk", None):
        return "sfa"
    return "mla"


def _spec_method_of(method: Any) -> str | None:
    if method is None:
        return None
    method = str(method)
    # vLLM spells DeepSeek's MTP variants "deepseek_mtp", "mtp", ...: they are one method here.
    return "mtp" if method.endswith("mtp") else method


def parse_kvpp_mode(value: Any) -> Mode:
    if not isinstance(value, str) or value not in KVPP_MODES:
        raise ValueError(f"additional_config.kvpp_mode must be one of {[m.value for m in KVPP_MODES]}, "
                         f"got {value!r}.")
    return Mode(value)


def check_keys(additional_config: Mapping[str, Any]) -> None:
    """A key that looks like KVPP's but is not one of them is a typo that would be silently ignored."""
    unknown = sorted(k for k in additional_config
                     if isinstance(k, str) and k.startswith(("kvpp", "enable_kvpp")) and k not in KNOWN_KEYS)
    if unknown:
        raise ValueError(f"unknown KVPP key(s) in additional_config: {unknown}; the known keys are "
                         f"{list(USER_KEYS)} ({KNOWN_KEYS[-1]!r} is written by kvpp-fx).")


@dataclass(frozen=True)
class KVPPConfig:
    """Whether KVPP is on, how large its group is (TP x PCP), and how steps move attention's inputs
    (``kvpp_mode``: "broadcast", "owner" or "auto", the cost model's choice per request), and how many
    blocks a scratch slot holds when the user fixes it (``kvpp_scratch_blocks``; None: the engine
    sizes slots from its max model length and token budget, or keeps whole-layer slots)."""

    enable_kvpp: bool = False
    tp: int = 1
    pcp: int = 1
    mode: Mode = Mode.AUTO
    scratch_blocks: int | None = None

    def __post_init__(self) -> None:
        _positive_int("tp", self.tp)
        _positive_int("pcp", self.pcp)
        object.__setattr__(self, "mode", parse_kvpp_mode(self.mode))
        if self.scratch_blocks is not None:
            _positive_int("additional_config.kvpp_scratch_blocks", self.scratch_blocks)

    @classmethod
    def from_additional_config(
        cls, additional_config: Mapping[str, Any] | None, *, tp: int = 1, pcp: int = 1
    ) -> KVPPConfig:
        if additional_config is not None and not isinstance(additional_config, Mapping):
            raise ValueError(
                f"additional_config must be a mapping, got {type(additional_config).__name__}."
            )
        additional_config = additional_config or {}
        check_keys(additional_config)
        raw = additional_config.get("enable_kvpp", False)
        mode = parse_kvpp_mode(additional_config.get("kvpp_mode", "auto"))
        scratch_blocks = additional_config.get("kvpp_scratch_blocks")
        return cls(enable_kvpp=parse_enable_kvpp(raw), tp=tp, pcp=pcp, mode=mode, scratch_blocks=scratch_blocks)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> KVPPConfig:
        parallel = getattr(vllm_config, "parallel_config", None)
        return cls.from_additional_config(
            getattr(vllm_config, "additional_config", None) or {},
            tp=int(getattr(parallel, "tensor_parallel_size", 1) or 1),
            pcp=int(getattr(parallel, "prefill_context_parallel_size", 1) or 1),
        )

    @property
    def size(self) -> int:
        return self.tp * self.pcp if self.enable_kvpp else 1

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def validate(self, deployment: Any) -> None:
        """Raise `ValueError` for the first rule the deployment breaks; a disabled config accepts all."""
        if not self.enabled:
            return
        d = Deployment.from_any(deployment)
        if d.dcp != 1:
            raise ValueError(MSG_DCP)
        if d.kv_connector is not None:
            check_connector(d)
        if d.graph_mode == "full":
            raise ValueError(MSG_GRAPH_MODE)
        if d.model_kind not in ("mla", "sfa"):
            raise ValueError(MSG_MODEL_KIND)
        if d.spec_method not in SUPPORTED_SPEC_METHODS:
            raise ValueError(MSG_SPEC_METHOD)
        if d.spec_method == "dspark" and d.adaptive_verification:
            raise ValueError(MSG_ADAPTIVE)
        if d.spec_method is not None and not d.spec_tokens_fixed:
            raise ValueError(MSG_SPEC_TOKENS)
