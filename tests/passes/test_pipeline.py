"""The pass pipeline as a whole: what each pass declares it reads and produces, the one layer reading per
compile, the first-prefetch rule the passes take from the schedule, and the key of vLLM's compile caches."""

import shutil
from types import SimpleNamespace

import pytest
import torch

from kvpp_fx.integrations.vllm.engine.state import Counters
from kvpp_fx.passes import layers as layer_reading
from kvpp_fx.passes.insert import insert_kvpp_ops
from kvpp_fx.passes.layers import GraphLayers
from kvpp_fx.passes.manager import (
    CodegenPass,
    InsertPass,
    KVPPPass,
    PassInputError,
    PassManager,
    RoutePass,
    SplitPass,
    VerifyPass,
)
from kvpp_fx.passes.registry import OpMatcher
from kvpp_fx.passes.sources import PACKAGE_ROOT, source_files, source_uuid
from kvpp_fx.passes.verify import KVPPGraphVerificationError, verify_graph
from kvpp_fx.reference.ops import REFERENCE_SPECS
from kvpp_fx.runtime.graph_ops import RoutedOp
from kvpp_fx.schedule import LayerSchedule, ScheduleStep
from tests.passes import toy
from tests.integrations.vllm.test_vllm_plan import vllm_style_graph
from tests.passes.test_passes import CONFIG, capture, kvpp_nodes, node_named
from tests.support.specs import TOY_VLLM_SPEC, pass_config
from tests.test_imports import MODULES, closure

# --- each pass declares what it reads and produces ------------------------------------------------------


def test_a_pass_that_reads_what_no_earlier_pass_produces_is_refused():
    with pytest.raises(PassInputError, match=r"pass 'route' reads 'inserted', which no earlier pass .* "
                                             r"\(the later pass 'insert' does\)"):
        PassManager(CONFIG, [RoutePass(print), InsertPass()])
    with pytest.raises(PassInputError, match="pass 'codegen' reads 'inserted', which no earlier pass"):
        PassManager(CONFIG, [CodegenPass()])
    with pytest.raises(PassInputError, match="pass 'verify' reads 'split', which the later pass 'split' produces"):
        PassManager(CONFIG, [InsertPass(), VerifyPass(), SplitPass()])
    # The control: both of the backend's pipelines, and one that never splits, are accepted.
    for mode in ("eager", "piecewise"):
        PassManager.for_mode(CONFIG, mode, print)
    PassManager(CONFIG, [InsertPass(), VerifyPass()])


def test_a_pass_is_handed_what_it_declares_and_nothing_else():
    seen = []

    class Peek(KVPPPass):
        name, reads, reads_if_produced, produces = "peek", ("inserted",), ("split", "routing"), "peeked"

        def __call__(self, gm, config, inputs):
            seen.append(sorted(inputs))
            return len(inputs)

    run = PassManager(CONFIG, [InsertPass(), RoutePass(RoutedOp), Peek()]).run(capture(), graph_breaks=False)
    assert seen == [["inserted", "routing"]]  # not the run's inputs, nor a split no pass produced
    assert run.values["peeked"] == 2 and run.inserted.layers == (0, 1, 2, 3)


# --- one layer reading per compile ----------------------------------------------------------------------

def count_readings(monkeypatch) -> list:
    """Every registered op's layer read from now on (the node of each reading)."""
    read = []
    real = layer_reading.read_op
    monkeypatch.setattr(layer_reading, "read_op", lambda node, *rest: read.append(node) or real(node, *rest))
    return read


def test_a_vllm_compile_reads_each_ops_layer_once(monkeypatch):
    """Mode 3's compile reads the graph's layers to choose the schedule, then hands that reading to the
    insert pass and the verifier: one reading per registered op, not one per consumer."""
    from kvpp_fx.integrations.vllm.attention import compilation

    monkeypatch.setattr(compilation, "VLLM_SPECS", (TOY_VLLM_SPEC,))
    names = {f"model.layers.{i}.self_attn.attn": i for i in range(2)}
    state = SimpleNamespace(plan=toy.toy_plan(2), vplan=SimpleNamespace(layer_index=names), counters=Counters())
    gm = vllm_style_graph(0, 1)
    read = count_readings(monkeypatch)
    compilation.rewrite_whole_graph(state, gm, [])
    assert [node.name for node in read] == ["unified_attention", "unified_attention_1"]
    assert state.counters.compiled_graphs == [("target", (0, 1))]
    assert [n.args[:2] for n in kvpp_nodes(gm, "wait")] == [(0, 0), (1, 1)]  # the graph was rewritten


def test_a_compile_given_no_reading_reads_once_before_its_passes(monkeypatch):
    read = count_readings(monkeypatch)
    run = PassManager.for_mode(CONFIG, "piecewise", RoutedOp).run(capture(), graph_breaks=False)
    assert len(read) == 8 and len(set(read)) == 8  # each layer's write and attention, once
    assert run.inserted.changed and "resolve_s" in run.timings


def test_the_verifier_reads_again_an_op_whose_layer_argument_changed():
    gm = capture()
    reading = GraphLayers.read(gm.graph, CONFIG.matcher, CONFIG.schedule.names)
    insert_kvpp_ops(gm, CONFIG, layers=reading)
    verify_graph(gm, CONFIG, layers=reading)
    attention = node_named(gm, "attn_2")
    attention.update_arg(len(attention.args) - 1, 3)  # layer 2's attention now names layer 3
    with pytest.raises(KVPPGraphVerificationError, match="attn_2 touches layer 3's cache before its wait"):
        verify_graph(gm, CONFIG, layers=reading)  # the reading from before the change is not taken for it


def test_a_reading_is_remapped_to_the_configs_names_and_refused_with_other_specs(monkeypatch):
    gm = vllm_style_graph(0, 1)
    reading = GraphLayers.read(gm.graph, OpMatcher((TOY_VLLM_SPEC,)))  # no name map: layers.N
    assert [op.layer for op in reading.ops] == [0, 1]
    swapped = {"model.layers.0.self_attn.attn": 1, "model.layers.1.self_attn.attn": 0}
    config = pass_config(LayerSchedule(target_layers=(1, 0), names=swapped), specs=(TOY_VLLM_SPEC,))
    read = count_readings(monkeypatch)
    assert [op.layer for op in reading.for_config(config).ops] == [1, 0] and read == []  # no graph read
    with pytest.raises(ValueError, match="read with other attention op specs"):
        GraphLayers.read(gm.graph, OpMatcher(REFERENCE_SPECS)).for_config(config)


# --- the first-prefetch rule is the schedule's ----------------------------------------------------------

def test_the_first_prefetch_follows_the_schedules_rule(monkeypatch):
    schedule = LayerSchedule(target_layers=(7, 0, 1))
    assert [schedule.pending_at_entry(layer) for layer in (7, 0, 1)] == [False, True, True]
    assert schedule.pending_at_entry(7, first_issued=True)
    assert schedule.entry(7) == (ScheduleStep("prefetch", 7, 0), *schedule.at_layer(7))
    assert schedule.entry(7, first_issued=True) == schedule.at_layer(7)  # a graph issued it: not again
    # The insert pass and the verifier place and expect the first prefetch by that one method: a rule
    # that says every layer is already in flight takes the first prefetch out of the rewritten graph, and
    # the verifier, following the same rule, expects none.
    monkeypatch.setattr(LayerSchedule, "pending_at_entry", lambda self, layer, first_issued=False: True)
    gm = capture()
    insert_kvpp_ops(gm, CONFIG)
    assert [n.args[0] for n in kvpp_nodes(gm, "prefetch")] == [1, 2, 3]
    verify_graph(gm, CONFIG)


# --- the key of vLLM's compile caches -------------------------------------------------------------------

def test_the_compile_key_covers_every_module_the_passes_import():
    passes = {name for name in MODULES if name.startswith("kvpp_fx.passes")}
    reached = passes | {module for name in passes for module in closure(name)}
    assert {"kvpp_fx.arguments", "kvpp_fx.schedule", "kvpp_fx.passes.layers", "kvpp_fx.passes.insert_checks",
            "kvpp_fx.passes.verify_facts"} <= reached
    covered = {path.resolve() for path in source_files()}
    assert sorted(name for name in reached if MODULES[name].resolve() not in covered) == []
    # The control: the runtime, which no pass imports, is outside the key.
    assert MODULES["kvpp_fx.runtime.graph_ops"].resolve() not in covered


def test_the_compile_key_changes_with_every_file_it_covers(tmp_path):
    root = tmp_path / "kvpp_fx"
    shutil.copytree(PACKAGE_ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    key = source_uuid(root)
    assert key == source_uuid()
    unchanged = []
    for path in source_files(root):
        original = path.read_bytes()
        path.write_bytes(original + b"\n# changed\n")
        if source_uuid(root) == key:
            unchanged.append(str(path.relative_to(root)))
        path.write_bytes(original)
    assert unchanged == [] and len(source_files(root)) > 20
    (root / "runtime" / "stats.py").write_text("# the runtime does not decide what a graph holds\n")
    assert source_uuid(root) == key  # control
