"""vLLM's compilation modes under KVPP: mode 3's splitting ops and graph modes, breakable-graph defaults,
the refused fusions, modes 1 and 2 through the kvpp backend, and the compile digest.

Like every `cases_*.py` file, run against vLLM's real classes in a pytest process of its own
(`test_vllm_objects.py::test_against_vllm_objects`: vLLM's import changes process-wide state; the name
keeps the main run from collecting it)."""

from __future__ import annotations

import tests.integrations.vllm.triton_interpreter  # noqa: F401, I001  (before vLLM: V2's Triton kernels, interpreted)

import types

import pytest

from kvpp_fx.integrations.vllm.setup.config import Deployment


def _compiled_config(**compilation):
    from vllm.config import CompilationConfig

    return types.SimpleNamespace(compilation_config=CompilationConfig(**compilation),
                                 additional_config={"enable_kvpp": True})


def test_mode_3_lowers_an_unchosen_full_and_piecewise_and_adds_the_kvpp_splitting_ops(caplog):
    from vllm.config import CUDAGraphMode

    from kvpp_fx.integrations.vllm.setup.compile_modes import (
        KVPP_SPLITTING_OPS,
        MSG_LOWERED,
        Requested,
        compile_digest,
        configure_compilation,
    )

    config = _compiled_config(mode=3, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    config.compilation_config.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter",
                                                        data_parallel_size=1)  # as vLLM resolves mode 3
    defaults = list(config.compilation_config.splitting_ops)
    with caplog.at_level("WARNING"):
        configure_compilation(config, Requested(cudagraph_mode=None))
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert MSG_LOWERED in caplog.text
    assert config.compilation_config.splitting_ops == defaults + list(KVPP_SPLITTING_OPS)
    assert config.additional_config["kvpp_fx"] == {"digest": compile_digest()}
    configure_compilation(config, Requested(cudagraph_mode="PIECEWISE"))  # a config resolved again
    assert config.compilation_config.splitting_ops == defaults + list(KVPP_SPLITTING_OPS)
    assert config.compilation_config.backend == "inductor"  # mode 3: vLLM's own per-piece compiler


@pytest.mark.parametrize("mode,asked", [("FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE"), ("FULL_DECODE_ONLY", None),
                                        ("FULL", None)])
def test_full_cudagraphs_that_cannot_be_lowered_are_refused(mode, asked):
    from vllm.config import CUDAGraphMode

    from kvpp_fx.integrations.vllm.setup.config import MSG_GRAPH_MODE
    from kvpp_fx.integrations.vllm.setup.compile_modes import MSG_DERIVED_FULL, Requested, configure_compilation

    config = _compiled_config(mode=3, cudagraph_mode=CUDAGraphMode[mode])
    with pytest.raises(ValueError) as err:
        configure_compilation(config, Requested(cudagraph_mode=asked))
    assert str(err.value) == MSG_DERIVED_FULL.format(mode=mode) and str(err.value).startswith(MSG_GRAPH_MODE)


def _resolved_by_vllm(architecture="DeepseekV3ForCausalLM", **compilation):
    """A config with `compilation`, through vLLM's own breakable-graph default and its piecewise
    normalisation (`VllmConfig.__post_init__`'s steps, which on vLLM CPU its platform overrides)."""
    import functools

    from vllm.config import VllmConfig

    config = _compiled_config(**compilation)
    config.model_config = types.SimpleNamespace(architectures=[architecture])
    config._uses_breakable_cudagraph_by_default = functools.partial(VllmConfig._uses_breakable_cudagraph_by_default,
                                                                    config)
    breakable = VllmConfig._maybe_enable_breakable_cudagraph(config)
    VllmConfig._normalize_piecewise_cudagraph_mode(config, breakable_cudagraph_enabled=breakable)
    return config


@pytest.fixture
def breakable_env():
    """vLLM's config sets VLLM_USE_BREAKABLE_CUDAGRAPH in the process environment for the models that
    default to breakable graphs; the test's process gets it back as it was."""
    import os

    import vllm.envs

    vllm.envs.disable_envs_cache()  # vLLM reads the variable where the test sets it, not a cached value
    before = os.environ.pop("VLLM_USE_BREAKABLE_CUDAGRAPH", None)
    yield
    os.environ.pop("VLLM_USE_BREAKABLE_CUDAGRAPH", None)
    if before is not None:
        os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = before


@pytest.mark.parametrize("architecture", ["DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"])
def test_models_that_default_to_breakable_graphs_resolve_to_piecewise_on_vllms_defaults(architecture, breakable_env,
                                                                                        caplog):
    from vllm.config import CUDAGraphMode

    from kvpp_fx.integrations.vllm.setup.compile_modes import MSG_LOWERED, Requested, configure_compilation
    from kvpp_fx.integrations.vllm.plugin import breakable_cudagraphs

    assert not breakable_cudagraphs()
    config = _resolved_by_vllm(architecture, mode=3, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    # vLLM's choice for these models: breakable graphs, mode 0, FULL_AND_PIECEWISE kept.
    assert breakable_cudagraphs() and config.compilation_config.mode == 0
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    with caplog.at_level("WARNING"):
        configure_compilation(config, Requested(cudagraph_mode=None), breakable=breakable_cudagraphs())
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE and MSG_LOWERED in caplog.text
    assert Deployment.from_vllm_config(config).graph_mode == "piecewise"  # then accepted by the KVPP rules
    # FULL_AND_PIECEWISE asked for stays refused, as in mode 3.
    config = _resolved_by_vllm(architecture, mode=3, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    with pytest.raises(ValueError, match="KVPP supports eager execution or PIECEWISE only"):
        configure_compilation(config, Requested(cudagraph_mode="FULL_AND_PIECEWISE"), breakable=True)


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_without_piecewise_graphs_a_full_mode_is_refused_saying_to_set_none(mode, breakable_env):
    from vllm.config import CUDAGraphMode

    from kvpp_fx.integrations.vllm.setup.config import MSG_GRAPH_MODE
    from kvpp_fx.integrations.vllm.setup.compile_modes import MSG_NO_PIECEWISE_MODE, Requested, configure_compilation

    config = _resolved_by_vllm(mode=mode, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    # vLLM's lowering outside mode 3, without breakable graphs: full graphs of decode steps only.
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    with pytest.raises(ValueError) as err:
        configure_compilation(config, Requested(cudagraph_mode=None))
    assert str(err.value) == MSG_NO_PIECEWISE_MODE.format(mode=mode, cudagraph="FULL_DECODE_ONLY")
    assert str(err.value).startswith(MSG_GRAPH_MODE) and "'cudagraph_mode': 'NONE'" in str(err.value)
    config = _resolved_by_vllm(mode=mode, cudagraph_mode=CUDAGraphMode.NONE)
    configure_compilation(config, Requested(cudagraph_mode="NONE"))
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE


def test_mode_3_keeps_vllms_mla_attention_and_cache_write_as_splitting_ops(caplog):
    from vllm.config import CUDAGraphMode
    from vllm.config.vllm import enable_rope_kvcache_mla_fusion

    from kvpp_fx.integrations.vllm.setup.compile_modes import (
        KVPP_SPLITTING_OPS,
        MLA_SPLITTING_OPS,
        MSG_ADDED_MLA_OPS,
        MSG_NO_ROPE_CACHE_FUSION,
        Requested,
        configure_compilation,
    )

    users = ["vllm::unified_attention_with_output", "vllm::unified_mla_attention_with_output"]
    config = _compiled_config(mode=3, cudagraph_mode=CUDAGraphMode.PIECEWISE, splitting_ops=list(users))
    config.compilation_config.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    # A user's list keeps the cache write in a piece, so vLLM's default turns on the rope + cache-write
    # fusion on CUDA (vLLM CPU's pass config turns it off, so it is set here as vLLM's default says).
    assert config.compilation_config.splitting_ops == users
    config.compilation_config.pass_config.fuse_rope_kvcache_cat_mla = enable_rope_kvcache_mla_fusion(config)
    assert config.compilation_config.pass_config.fuse_rope_kvcache_cat_mla
    with caplog.at_level("WARNING"):
        configure_compilation(config, Requested(cudagraph_mode="PIECEWISE"))
    assert config.compilation_config.splitting_ops == users + ["vllm::unified_mla_kv_cache_update",
                                                               *KVPP_SPLITTING_OPS]
    assert set(MLA_SPLITTING_OPS) <= set(config.compilation_config.splitting_ops)
    assert config.compilation_config.splitting_ops_contain_kv_cache_update() is False  # MHA's write: not KVPP's
    assert not config.compilation_config.pass_config.fuse_rope_kvcache_cat_mla
    assert MSG_ADDED_MLA_OPS.format(ops=["vllm::unified_mla_kv_cache_update"]) in caplog.text
    assert MSG_NO_ROPE_CACHE_FUSION in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        configure_compilation(config, Requested(cudagraph_mode="PIECEWISE"))  # resolved again: unchanged, quiet
    assert config.compilation_config.splitting_ops.count("vllm::unified_mla_kv_cache_update") == 1
    assert "KVPP" not in caplog.text


def test_attention_quant_fusion_is_refused_in_mode_3():
    from kvpp_fx.integrations.vllm.setup.compile_modes import MSG_ATTN_FUSION, Requested, configure_compilation

    from vllm.config import CUDAGraphMode

    config = _compiled_config(mode=3, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                              pass_config={"fuse_attn_quant": True})
    config.compilation_config.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    assert config.compilation_config.splitting_ops == []  # vLLM's: attention inside a piece, FULL graphs
    with pytest.raises(ValueError) as err:
        configure_compilation(config, Requested(cudagraph_mode=None))
    assert str(err.value) == MSG_ATTN_FUSION


def test_inductor_graph_partition_is_refused():
    from kvpp_fx.integrations.vllm.setup.compile_modes import MSG_GRAPH_PARTITION, Requested, configure_compilation

    config = _compiled_config(mode=3, use_inductor_graph_partition=True)
    with pytest.raises(ValueError) as err:
        configure_compilation(config, Requested(cudagraph_mode=None))
    assert str(err.value) == MSG_GRAPH_PARTITION


@pytest.mark.parametrize("backend,inner", [("inductor", "inductor"), ("eager", "eager"), ("aot_eager", "aot_eager")])
def test_modes_1_and_2_compile_through_the_kvpp_backend(backend, inner):
    from kvpp_fx.integrations.vllm.setup.compile_modes import (KVPP_BACKEND, Requested, configure_compilation,
                                                               inner_backend)

    for mode in (1, 2):
        config = _compiled_config(mode=mode, backend=backend)
        configure_compilation(config, Requested(cudagraph_mode=None))
        assert config.compilation_config.backend == KVPP_BACKEND
        assert inner_backend(config) == inner
        configure_compilation(config, Requested(cudagraph_mode=None))  # resolved again: unchanged
        assert (config.compilation_config.backend, inner_backend(config)) == (KVPP_BACKEND, inner)


def test_the_compile_digest_covers_the_passes(tmp_path):
    import shutil

    from kvpp_fx.integrations.vllm.setup.compile_modes import compile_digest
    from kvpp_fx.passes.sources import PACKAGE_ROOT
    from kvpp_fx.passes.sources import source_uuid as digest_of

    copy = tmp_path / "kvpp_fx"
    shutil.copytree(PACKAGE_ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert digest_of(copy) == compile_digest()
    insert = copy / "passes" / "insert.py"
    insert.write_text(insert.read_text() + "\n# changed\n")
    assert digest_of(copy) != compile_digest()
    (copy / "runtime" / "stats.py").write_text("# the runtime does not decide what a graph holds\n")
    insert.write_text((PACKAGE_ROOT / "passes" / "insert.py").read_text())
    assert digest_of(copy) == compile_digest()


def test_kvpp_workers_build_vllms_backend_as_the_kvpp_subclass():
    from vllm.compilation import backends
    from vllm.config import CompilationMode, VllmConfig

    from kvpp_fx.integrations.vllm.attention.compilation import install_vllm_backend, kvpp_vllm_backend_class

    original = backends.VllmBackend
    try:
        install_vllm_backend()
        ours = kvpp_vllm_backend_class()
        assert backends.VllmBackend is ours and issubclass(ours, original)
        config = VllmConfig()
        config.compilation_config.mode = CompilationMode.VLLM_COMPILE  # vLLM CPU resolves mode 3 into 2
        # vLLM's own choice of backend, at the place it builds the model's.
        assert type(config.compilation_config.init_backend(config)) is ours
        install_vllm_backend()  # a second engine in the process: still one subclass of vLLM's class
        assert backends.VllmBackend is ours and ours.__mro__[1] is original
    finally:
        backends.VllmBackend = original
