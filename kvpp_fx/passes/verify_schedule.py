"""The verifier's checks of the kvpp ops against the plan's schedule (`verify.CHECKS`): ``layers``,
``counts``, ``slots``, ``outstanding``, ``order`` and ``slot_reuse``.

Invariant: each check is a function of the `GraphFacts` alone that yields one message per problem; the
order, slots and first prefetch it expects are the `LayerSchedule`'s (`entry`, `slot`,
`pending_at_entry`), computed nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.fx

from kvpp_fx.passes.verify_facts import GraphFacts
from kvpp_fx.schedule import PREFETCH


def check_layers(g: GraphFacts) -> Iterator[str]:
    yield from g.unresolved
    for node in g.all_waits + g.all_prefetches:
        layer = node.args[0] if node.args else None
        if layer in g.drafts:
            yield f"{node.name} is a kvpp op for draft layer {layer}, which is never broadcast."
        elif not g.schedule.is_target(layer):
            yield (f"{node.name} is a kvpp op for layer {layer!r}, which is not a target layer of the plan "
                   f"{list(g.schedule.target_layers)}.")
    for op in g.all_registered:
        if not g.schedule.is_target(op.layer):
            yield f"{op.node.name} touches layer {op.layer}, which is neither a target nor a draft."
    held = g.held
    positions = [g.schedule.position(layer) for layer in held]
    if held and positions != list(range(positions[0], positions[-1] + 1)):
        yield f"the graph holds layers {held}, not a contiguous run of the plan {list(g.schedule.target_layers)}."


def check_counts(g: GraphFacts) -> Iterator[str]:
    for layer in g.held:
        awaited = sum(w.args[0] == layer for w in g.waits)
        if awaited != 1:
            yield f"layer {layer} is awaited {awaited} times, expected once."
    expected = [step.layer for step in g.expected if step.kind == PREFETCH]
    prefetched = [p.args[0] for p in g.prefetches]
    for layer in dict.fromkeys(expected + prefetched):
        got, want = prefetched.count(layer), expected.count(layer)
        if got != want:
            yield f"layer {layer} is prefetched {got} times, expected {want}."


def check_slots(g: GraphFacts) -> Iterator[str]:
    for node in g.waits + g.prefetches:
        layer, slot = node.args[0], node.args[1]
        if slot != g.schedule.slot(layer):
            yield f"{node.name} uses slot {slot!r} for layer {layer}; the plan's slot is {g.schedule.slot(layer)}."


def check_outstanding(g: GraphFacts) -> Iterator[str]:
    """One prefetch in flight, and each wait completes it."""
    pending = g.held[0] if g.held and g.schedule.pending_at_entry(g.held[0]) else None
    for kind, node in g.kvpp_in_order:
        layer = node.args[0]
        if not g.schedule.is_target(layer):
            continue
        if kind == PREFETCH:
            if pending is not None:
                yield f"{node.name} prefetches layer {layer} while layer {pending}'s prefetch is still outstanding."
            pending = layer
        else:
            if pending != layer:
                yield (f"{node.name} waits for layer {layer}, but the outstanding prefetch is "
                       f"{'none' if pending is None else f'layer {pending}'}.")
            pending = None


def check_order(g: GraphFacts) -> Iterator[str]:
    for what, seq in (("prefetches", [p.args[0] for p in g.prefetches]), ("waits", [w.args[0] for w in g.waits])):
        positions = [g.schedule.position(l) for l in seq]
        if positions != sorted(positions):
            yield f"the graph's {what} run over layers {seq}, not in the plan's order {list(g.schedule.target_layers)}."


def check_slot_reuse(g: GraphFacts) -> Iterator[str]:
    """Each prefetch against the readers of earlier layers on its slot: the layer's views, their
    readers and its registered ops."""
    readers: dict[int, list[torch.fx.Node]] = {layer: [] for layer in g.held}
    for layer, wait in g.wait_of.items():
        for user in wait.users:
            readers[layer].append(user)
            readers[layer].extend(user.users)
    for op in g.registered:
        readers[op.layer].append(op.node)
    last_read = {layer: max((g.position[n] for n in ns), default=-1) for layer, ns in readers.items()}
    for prefetch in g.prefetches:
        layer = prefetch.args[0]
        slot = g.schedule.slot(layer)
        for earlier in g.held:
            if g.schedule.position(earlier) < g.schedule.position(layer) and g.schedule.slot(earlier) == slot \
                    and last_read[earlier] > g.position[prefetch]:
                late = sorted({n.name for n in readers[earlier] if g.position[n] > g.position[prefetch]})
                yield (f"{prefetch.name} refills slot {slot} for layer {layer} before the last reader of layer "
                       f"{earlier} ({', '.join(late)}).")
