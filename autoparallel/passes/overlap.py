"""Schedule the forward's collectives so that compute runs while they are in flight.

A ``_c10d_functional`` collective starts when it is called and its result may be read only
after ``wait_tensor``. :func:`apply_plan` emits each wait right after its collective;
:func:`overlap_collectives` then

* moves every wait down to just before the first node that reads its result, so that the
  ops in between (independent of the collective) run while it is in flight;
* starts the all-gather of a parameter kept sharded (FSDP-style, ZeRO-3: Rajbhandari et
  al., SC 2020, §5) one gather ahead: the gather of the next parameter is issued right
  after the previous gathered parameter becomes available, so it runs beside the compute
  that uses the previous one (FSDP's forward prefetch, Zhao et al., VLDB 2023, §3.3.1);
* merges all-reduces (sum) of one value over several mesh axes in a row into one
  :func:`~autoparallel.runtime_kernels.grad_reduction.sum_over_axes` (one all-reduce over the
  world when the axes span it, no wait between);
* issues each collective computed from the inputs alone (no parameter: a loss's count of
  labels that are not ignored) right after the graph's inputs, so the whole forward runs
  while it is in flight and its wait no longer holds the ranks together late in the forward;
* fuses a pending sum returned whole (``all_reduce`` or ``sum_over_axes`` → ``wait_tensor`` →
  ``returned``) into
  :func:`~autoparallel.runtime_kernels.grad_reduction.deferred_reduced_output`: one
  all-reduce (over the world's group when the axes span it), waited when the value is read or
  the backward ends instead of in the forward, and no all-reduce in its backward.

Besides the order of the graph, only the grouping of sums changes (the same sum, one collective
instead of one per axis) and where a returned sum is waited: every rank still issues the same
forward collectives in the same order, and the values are the same up to the summation order.
It runs on the top-level graph after checkpointing, so checkpoint regions (sub-modules) keep
their own order.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph import alias_source, written_args
from ..runtime_kernels import returned
from ..runtime_kernels.grad_reduction import deferred_reduced_output, sum_over_axes

_c10d = torch.ops._c10d_functional
_WAIT = _c10d.wait_tensor.default
_COLLECTIVES = {_c10d.all_reduce.default, _c10d.all_gather_into_tensor.default, _c10d.reduce_scatter_tensor.default,
                _c10d.all_to_all_single.default, sum_over_axes}


def data_dependent(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose value depends on a graph input (placeholder); the others are computed
    from parameters, buffers and constants only."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder" or any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def sink_waits(graph: fx.Graph) -> int:
    """Move each ``wait_tensor`` to just before its first reader. Returns how many moved."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    moved = 0
    for w in [n for n in graph.nodes if n.op == "call_function" and n.target is _WAIT]:
        if not w.users:
            continue
        first = min(w.users, key=order.__getitem__)
        if first is not w.next:
            first.prepend(w)
            moved += 1
    return moved


def prefetch_param_gathers(graph: fx.Graph) -> int:
    """Issue each parameter all-gather right after the previous one's wait (with the ops
    preparing its input, unless one of them writes in place or reads a value written in place:
    :func:`_movable`, :func:`_written_in_place`). Returns how many gathers moved earlier."""
    data = data_dependent(graph)
    gathers = [n for n in graph.nodes if n.op == "call_function" and n not in data
               and n.target is _c10d.all_gather_into_tensor.default]
    moved = 0
    for prev, cur in zip(gathers, gathers[1:]):
        waits = [u for u in prev.users if u.target is _WAIT]
        if len(waits) != 1:
            continue
        anchor = waits[0]
        order = {n: i for i, n in enumerate(graph.nodes)}
        if order[cur] < order[anchor]:
            continue
        chain = _ancestors_after(cur, order[anchor], order)
        if any(not _movable(n) or _written_in_place(n) for n in chain):
            continue
        for n in sorted(chain, key=order.__getitem__):
            anchor.append(n)
            anchor = n
        moved += 1
    return moved


def _ancestors_after(node: fx.Node, pos: int, order: dict[fx.Node, int]) -> set[fx.Node]:
    """``node`` and its ancestors that come after position ``pos`` in the graph."""
    out, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in out or order[n] <= pos:
            continue
        out.add(n)
        todo.extend(n.all_input_nodes)
    return out


def hoist_input_collectives(graph: fx.Graph) -> int:
    """Issue each collective whose value comes from the graph's inputs alone (no parameter,
    buffer or constant among its ancestors) right after the inputs, with the ops preparing
    its input, keeping the collectives' order. Returns how many moved earlier."""
    anchor = max((n for n in graph.nodes if n.op == "placeholder"), default=None, key=list(graph.nodes).index)
    if anchor is None:
        return 0
    from_state: set[fx.Node] = set()  # nodes computed (in part) from parameters, buffers or constants
    for n in graph.nodes:
        if n.op == "get_attr" or any(a in from_state for a in n.all_input_nodes):
            from_state.add(n)
    moved = 0
    for c in [n for n in graph.nodes if n.op == "call_function" and n.target in _COLLECTIVES]:
        order = {n: i for i, n in enumerate(graph.nodes)}
        cone = _ancestors_after(c, order[anchor], order)
        if c in from_state or any(not _movable(n) or _written_in_place(n) for n in cone):
            continue
        if all(order[n] == order[anchor] + 1 + i for i, n in enumerate(sorted(cone, key=order.__getitem__))):
            anchor = c  # already right after the anchor
            continue
        for n in sorted(cone, key=order.__getitem__):
            anchor.append(n)
            anchor = n
        moved += 1
    return moved


def _movable(node: fx.Node) -> bool:
    """Whether ``node`` may run earlier: a call that writes nothing in place and draws no
    random numbers (which would shift the random stream)."""
    if node.op != "call_function":
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return False
    return torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ())


def _written_in_place(node: fx.Node) -> bool:
    """Whether an op writes ``node``'s value in place, directly or through a view of it (T5
    builds its decoder inputs in a ``zeros`` written through a slice and a select): moved
    earlier, a reader of ``node`` would read it before those writes."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        for user in n.users:
            if user in seen:
                continue
            seen.add(user)
            if any(v is n for _, v in written_args(user)):
                return True
            if alias_source(user) is n:  # a view: its writes are n's
                todo.append(user)
    return False


def _sum(node) -> tuple[fx.Node, tuple[str, ...]] | None:
    """``(x, groups)`` when ``node`` all-reduces ``x`` (sum) over ``groups`` (an ``all_reduce``
    over one mesh axis' group or a :func:`sum_over_axes`), else ``None``."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is _c10d.all_reduce.default and node.args[1] == "sum":
        return node.args[0], (node.args[2],)
    if node.target is sum_over_axes:
        return node.args[0], tuple(node.args[1])
    return None


def _waited_sum(w) -> tuple[fx.Node, fx.Node, tuple[str, ...]] | None:
    """``(collective, x, groups)`` when ``w`` is ``wait_tensor`` of a sum of ``x`` over
    ``groups`` (:func:`_sum`), each read by the next alone, else ``None``."""
    if not (isinstance(w, fx.Node) and w.target is _WAIT and len(w.users) == 1 and len(w.args[0].users) == 1):
        return None
    found = _sum(w.args[0])
    return (w.args[0], *found) if found else None


def merge_sum_chains(graph: fx.Graph) -> int:
    """Replace each all-reduce (sum) over one mesh axis of a value all-reduced over other axes
    just before, ``all_reduce(wait_tensor(all_reduce(x, "sum", g1)), "sum", g2)`` (the wait and
    first collective read by nothing else), by ``sum_over_axes(x, (g1, g2))``: one collective
    over the world when the axes span it, with no wait between. Returns how many merged."""
    merged = 0
    for c in [n for n in graph.nodes if _sum(n) is not None]:
        w, groups = _sum(c)
        inner = _waited_sum(w)
        if inner is None:
            continue
        first, x, before = inner
        with graph.inserting_before(c):
            new = graph.call_function(sum_over_axes, (x, before + groups))
        new.meta = {k: v for k, v in c.meta.items() if k != "comment"}
        comment = first.meta.get("comment") or c.meta.get("comment")
        if comment:
            new.meta["comment"] = comment
        c.replace_all_uses_with(new)
        for n in (c, w, first):
            graph.erase_node(n)
        merged += 1
    return merged


def fuse_returned_sums(graph: fx.Graph) -> int:
    """Replace each ``returned(wait_tensor(all_reduce(x, "sum", g)), copies)`` (or of a
    :func:`sum_over_axes` of ``x`` over ``groups``) whose collective and wait have no other
    reader by ``deferred_reduced_output(x, groups, copies)``. Returns how many were replaced."""
    fused = 0
    for r in [n for n in graph.nodes if n.op == "call_function" and n.target is returned]:
        found = _waited_sum(r.args[0])
        if found is None:
            continue
        c, x, groups = found
        with graph.inserting_before(r):
            new = graph.call_function(deferred_reduced_output, (x, groups, r.args[1]))
        new.meta = dict(r.args[0].meta)
        if c.meta.get("comment"):
            new.meta["comment"] = c.meta["comment"]
        w = r.args[0]
        r.replace_all_uses_with(new)
        for n in (r, w, c):
            graph.erase_node(n)
        fused += 1
    return fused


def overlap_collectives(graph: fx.Graph) -> dict[str, int]:
    """Apply :func:`merge_sum_chains`, :func:`fuse_returned_sums`, :func:`hoist_input_collectives`,
    :func:`sink_waits` then :func:`prefetch_param_gathers` to ``graph`` (in this order: a gather is issued after
    the previous gathered parameter's wait has moved to its first reader, so at most one
    gather is ahead of the compute); the caller recompiles. Returns the counts of moved nodes."""
    stats = {"merged_sums": merge_sum_chains(graph), "fused_returned_sums": fuse_returned_sums(graph),
             "hoisted": hoist_input_collectives(graph),
             "sunk_waits": sink_waits(graph), "prefetched_gathers": prefetch_param_gathers(graph)}
    graph.lint()
    return stats
