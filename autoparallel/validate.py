"""Check a Plan against the graph it is applied to.

A plan names graph nodes and says how to place their tensors; the passes trust it. A plan
made for another model, for other input shapes or another mesh, or edited by hand, would
otherwise crash deep in the passes or, worse, train something else than the model. The
plan cache (:mod:`autoparallel.cache`) validates every plan it loads; a plan a user hands
in should be validated the same way.

What is checked (every field the emitted module depends on):

* the mesh shape, when the caller knows the mesh;
* nodes: the plan describes exactly the graph's nodes, each with the graph's op, module
  path, input and output shapes; every spec is legal for its tensor and the mesh
  (:func:`~autoparallel.placement.spec_problem`); each node's (input specs, output specs)
  is one of the strategies the sharding rules give that node on this mesh (so the op
  computes what it computes on one device); a ``getitem`` has its producer's output spec;
  a buffer the forward updates in place is replicated;
* ``param_placements``: exactly the graph's parameter and buffer names (tied names
  included), each at the spec of its ``get_attr`` node; ``state_placements``: trainable
  parameters only, each cut evenly along its state's dim;
* redistributions: one per graph edge whose producer and consumer specs differ and none
  elsewhere (a graph output is consumed in the placements
  :func:`~autoparallel.plan.returned_spec` gives for the plan's ``outputs`` mode, buffer
  write-backs replicated); each names its edge's producer,
  output index and shape, and its moves, each legal where it is applied (as
  :mod:`autoparallel.solver.layout` defines them), turn the producer's spec into the
  consumer's; no edge into an in-place op or its view chain is resharded;
* inputs: under ``inputs="local"`` every tensor input is split as
  :func:`~autoparallel.strategies.generator.split_inputs` splits it (each rank's own batch);
  under ``"global"`` replicated;
* checkpoint: the node stages are those the graph's chain gives (:meth:`Plan.from_json`
  checks that the regions form a tree over those stages; which stages a region covers
  changes what is recomputed, not what is computed).

Informational fields, not checked: per-node ``compute_s``, ``comm_s``, ``memory_bytes``,
each redistribution's ``cost_s`` and each move's ``nbytes``, the mesh's axis names, alpha and
beta, ``estimate``, ``solver_stats``, ``inspection``, and the checkpoint ``table``, ``recompute_s``,
``chain_peak_bytes`` and ``every_stage``: no pass reads them, they change what the plan
reports, not what the module computes.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch.fx as fx
from torch.distributed.tensor import Shard

from .errors import PlanMismatchError
from .placement import P, R, Spec, is_valid, local_shape, shard, shard_axes, spec_problem, spec_str, uneven_dims
from .plan import Move, Plan, returned_spec
from .graph import output_leaves, tensor_inputs
from .solver.decode import op_name
from .solver.pricing import aliased_edges, written_back_outputs
from .solver.remat import chain_stages
from .strategies import StrategyGenerator
from .strategies.generator import split_inputs
from .tracer.annotate import node_info

_HINT = ("the plan was made for another model, other input shapes or another mesh, or was edited; make one "
         "for this model with autoparallel.plan(model, meta_inputs, mesh_shape=...) and the same inputs")


def _mismatch(where: str, what: str, expected=None, found=None) -> PlanMismatchError:
    detail = f": the graph needs {expected}, the plan has {found}" if expected is not None or found is not None else ""
    return PlanMismatchError(f"plan does not fit the graph at {where}: {what}{detail}. Probably {_HINT}")


def _node_where(node: fx.Node) -> str:
    path = node.meta["autoparallel"].module_path if "autoparallel" in node.meta else ""
    return f"node {node.name} ({op_name(node)}, module {path or '<root>'})"


def _fmt(spec: Spec, shape) -> str:
    return spec_str(spec, len(shape))


def validate_plan(plan: Plan, traced, *, mesh_shape: Sequence[int] | None = None) -> None:
    """Check that ``plan`` fits ``traced``: that applying it computes what the model computes
    (the checks are listed in the module docstring).

    Args:
        plan: the plan, e.g. from :meth:`Plan.from_json`.
        traced: the model's :class:`~autoparallel.tracer.capture.TracedModel` (the capture
            of the model and inputs the plan is to run).
        mesh_shape: devices per mesh axis of the mesh the plan will run on; ``None`` to
            check the plan against its own mesh only.

    Raises:
        PlanMismatchError: naming the first mismatch (node, field, what the graph needs and
            what the plan has) and what to do.

    Costs one run of the strategy generator over the graph (tens of milliseconds for
    GPT-2-sized graphs; see docs/design.md, "Validating plans").
    """
    ms = tuple(plan.mesh.shape)
    if mesh_shape is not None and tuple(mesh_shape) != ms:
        raise PlanMismatchError(f"the plan is for a mesh of shape {ms}, the mesh it is to run on has shape "
                                f"{tuple(mesh_shape)}; make a plan for this mesh with autoparallel.plan(model, "
                                f"meta_inputs, mesh_shape={tuple(mesh_shape)})")
    gm = traced.gm
    gen = StrategyGenerator(ms)
    strategies = gen.generate(gm)
    if plan.inputs == "local":  # each rank's own batch: every tensor input split as the planner splits it
        try:
            split_inputs(strategies, ms)
        except ValueError as e:
            raise PlanMismatchError(f"the plan takes local inputs (inputs='local'), but {e}") from None
    expected = [n for n in gm.graph.nodes if n in strategies or n in gen.aliases]
    names = {n.name for n in expected}
    for n in expected:
        if n.name not in plan.nodes:
            raise _mismatch(_node_where(n), "the plan has no entry for this node")
    extra = [k for k in plan.nodes if k not in names]
    if extra:
        raise _mismatch(f"node {extra[0]}", "the graph has no such node (or it carries no tensor)")
    allowed: dict[int, set] = {}  # id of a strategy list (shared by nodes alike) -> its (inputs, outputs)
    for n in expected:
        _check_node(plan, n, strategies, gen.aliases, ms, allowed)
    _check_mutated_buffers(plan, gm, traced)
    _check_params(plan, gm, strategies, traced)
    _check_redistributions(plan, gm, strategies, gen.aliases, ms,
                           written_back_outputs(gm, traced.buffer_mutations))
    if plan.checkpoint:
        _check_checkpoint(plan, gm)


def _check_node(plan: Plan, node: fx.Node, strategies, aliases, ms, allowed: dict[int, set]) -> None:
    where = _node_where(node)
    np_ = plan.nodes[node.name]
    info = node_info(node)
    alias = aliases.get(node)
    op = "getitem" if alias else op_name(node)
    if np_.op != op:
        raise _mismatch(where, "op", op, np_.op)
    if np_.module_path != info.module_path:
        raise _mismatch(where, "module_path", repr(info.module_path), repr(np_.module_path))
    in_shapes = [tuple(x.meta["val"].shape) for _, x in tensor_inputs(node)] \
        if node.op == "call_function" and not alias else []
    out_shapes = [sh for sh, _ in info.outputs]
    if [tuple(s) for s in np_.in_shapes] != in_shapes:
        raise _mismatch(where, "in_shapes", in_shapes, [tuple(s) for s in np_.in_shapes])
    if [tuple(s) for s in np_.out_shapes] != out_shapes:
        raise _mismatch(where, "out_shapes", out_shapes, [tuple(s) for s in np_.out_shapes])
    if alias:
        u, idx = alias
        want = [tuple(plan.nodes[u.name].output_specs[idx])] if idx < len(plan.nodes[u.name].output_specs) else None
        if np_.input_specs or [tuple(s) for s in np_.output_specs] != want:
            raise _mismatch(where, f"a getitem has output {idx} of {u.name} as its only spec",
                            f"input_specs [] and output_specs {want}", f"{np_.input_specs} and {np_.output_specs}")
        return
    ins, outs = [tuple(s) for s in np_.input_specs], [tuple(s) for s in np_.output_specs]
    if len(ins) != len(in_shapes) or len(outs) != len(out_shapes):
        raise _mismatch(where, "number of specs", f"{len(in_shapes)} inputs and {len(out_shapes)} outputs",
                        f"{len(ins)} and {len(outs)}")
    for field, specs, shapes in (("input_specs", ins, in_shapes), ("output_specs", outs, out_shapes)):
        for i, (spec, shape) in enumerate(zip(specs, shapes)):
            problem = spec_problem(spec, shape, ms)
            if problem:
                raise _mismatch(where, f"{field}[{i}] {list(spec)} {problem}")
    options = strategies[node]
    if id(options) not in allowed:
        allowed[id(options)] = {(s.inputs, s.outputs) for s in options}
    if (tuple(ins), tuple(outs)) not in allowed[id(options)]:
        got = ", ".join(_fmt(s, sh) for s, sh in zip(ins, in_shapes))
        got = f"{got} → " if got else ""
        got += ", ".join(_fmt(s, sh) for s, sh in zip(outs, out_shapes))
        raise _mismatch(where, f"the strategy {got} is not one the sharding rules give this op on mesh {ms} "
                        f"(it has {len(options)}, e.g. {_strategy_str(options[0], in_shapes, out_shapes)})")


def _strategy_str(s, in_shapes, out_shapes) -> str:
    ins = ", ".join(_fmt(x, sh) for x, sh in zip(s.inputs, in_shapes))
    outs = ", ".join(_fmt(x, sh) for x, sh in zip(s.outputs, out_shapes))
    return f"{ins} → {outs}" if ins else outs


def _check_mutated_buffers(plan: Plan, gm: fx.GraphModule, traced) -> None:
    written = set(traced.buffer_mutations.values())
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in written and node.name in plan.nodes:
            spec = tuple(plan.nodes[node.name].output_specs[0])
            if any(p != R for p in spec):
                raise _mismatch(_node_where(node), f"buffer {node.target} is updated in place by the forward",
                                "replicated", list(spec))


def _check_params(plan: Plan, gm: fx.GraphModule, strategies, traced) -> None:
    """``param_placements``: every name of every parameter and buffer the graph reads, at the
    spec of its ``get_attr`` node(s)."""
    want: dict[str, tuple[Spec, fx.Node]] = {}
    names = dict(traced.params)
    names.update(traced.buffers)
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node not in strategies or node.target not in names:
            continue
        spec = tuple(plan.nodes[node.name].output_specs[0])
        for name in names[node.target]:
            if name in want and want[name][0] != spec:
                raise _mismatch(_node_where(node), f"{name} is read by {want[name][1].name} and {node.name}, "
                                "which the plan places differently", list(want[name][0]), list(spec))
            want[name] = (spec, node)
    for name, (spec, node) in want.items():
        have = plan.param_placements.get(name)
        if have is None:
            raise _mismatch(f"param_placements[{name!r}]", "the plan has no placement for this parameter/buffer",
                            list(spec), None)
        if tuple(have) != spec:
            raise _mismatch(f"param_placements[{name!r}]", f"the spec of node {node.name}", list(spec), list(have))
    extra = [k for k in plan.param_placements if k not in want]
    if extra:
        raise _mismatch(f"param_placements[{extra[0]!r}]", "the graph reads no parameter or buffer of this name")
    for name, state in plan.state_placements.items():
        node = want[name][1]
        info = node_info(node)
        axes = [a for a, (p, q) in enumerate(zip(state, want[name][0])) if p != q]
        dim, size = state[axes[0]].dim, info.outputs[0][0]
        pieces = math.prod(plan.mesh.shape[a] for a in axes)
        if not info.requires_grad or dim >= len(size) or size[dim] % pieces:
            raise _mismatch(f"state_placements[{name!r}]", f"a shard of trainable parameter {node.target} "
                            f"{list(size)} cut evenly along one dim", list(state))


def _edges(gm: fx.GraphModule, strategies, aliases):
    """``(consumer name, input position) -> (input node, (producer, output index), consumer)``
    for every data edge the planner prices; the graph output is consumer ``"output"``."""
    edges = {}
    for node in strategies:
        if node.op != "call_function":
            continue
        for j, (_, x) in enumerate(tensor_inputs(node)):
            edges[(node.name, j)] = (x, aliases.get(x, (x, 0)), node)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for j, x in enumerate(output_leaves(out)):
        edges[("output", j)] = (x, aliases.get(x, (x, 0)), None)
    return edges


def _check_redistributions(plan: Plan, gm: fx.GraphModule, strategies, aliases, ms, whole: frozenset[int]) -> None:
    """Redistributions exactly on the edges whose specs differ, each turning its producer's
    spec into its consumer's; graph output ``j`` is consumed in ``returned_spec`` of
    ``plan.outputs`` (replicated where ``j`` is in ``whole``: buffer write-backs)."""
    edges = _edges(gm, strategies, aliases)
    pinned = {(n.name, j) for n, j in aliased_edges(list(strategies))}
    seen = {}
    for i, c in enumerate(plan.redistributions):
        where = f"redistributions[{i}] (into {c.dst} input {c.arg})"
        key = (c.dst, c.arg)
        if key not in edges:
            raise _mismatch(where, "the graph has no such input")
        if key in seen:
            raise _mismatch(where, f"a second redistribution for the same input (first: redistributions[{seen[key]}])")
        seen[key] = i
        x, (u, idx), _ = edges[key]
        if (c.src, c.src_index) != (u.name, idx):
            raise _mismatch(where, "source value", f"output {idx} of {u.name}", f"output {c.src_index} of {c.src}")
        shape, dtype = node_info(u).outputs[idx]
        if tuple(c.shape) != tuple(shape):
            raise _mismatch(where, "shape", tuple(shape), tuple(c.shape))
    for key, (x, (u, idx), consumer) in edges.items():
        src = tuple(plan.nodes[x.name].output_specs[0])
        dst = returned_spec(src, plan.outputs, key[1] in whole) if consumer is None \
            else tuple(plan.nodes[consumer.name].input_specs[key[1]])
        where = f"input {key[1]} of {key[0]} (from {u.name}" + (f" output {idx})" if idx else ")")
        shape, dtype = node_info(u).outputs[idx]
        c = plan.redistributions[seen[key]] if key in seen else None
        if c is None:
            if src != dst:
                raise _mismatch(where, f"no redistribution from {_fmt(src, shape)} to {_fmt(dst, shape)}",
                                "a redistribution", "none")
            continue
        if key in pinned and (src != dst or c.moves):
            raise _mismatch(where, "the input of an in-place op (or a view of it) must not be resharded: the "
                            "op would write into a copy")
        end = src
        for k, m in enumerate(c.moves):
            end = _apply_move(end, shape, dtype.is_floating_point, m, ms,
                              f"redistributions[{seen[key]}] (into {c.dst} input {c.arg}): moves[{k}]")
        if end != dst:
            raise _mismatch(f"redistributions[{seen[key]}] (into {c.dst} input {c.arg})",
                            f"its moves turn {_fmt(src, shape)} into {_fmt(end, shape)}", _fmt(dst, shape),
                            _fmt(end, shape))


def _apply_move(spec: Spec, shape, is_float: bool, m: Move, ms, where: str) -> Spec:
    """The spec after move ``m``; raises PlanMismatchError where the layout converter would
    not make this move (see :mod:`autoparallel.solver.layout`)."""
    a = m.axis
    if not 0 <= a < len(ms) or ms[a] == 1:
        raise _mismatch(where, f"{m.kind} along mesh axis {a}: the mesh {ms} has no such axis of more than 1 device")
    n = len(shape)
    loc = local_shape(shape, spec, ms)
    p = spec[a]

    def appendable(d) -> bool:  # a new split of dim d along axis a goes after its existing ones, validly
        return d is not None and 0 <= d < n and all(x < a for x in shard_axes(spec, d)) and \
            is_valid(spec[:a] + (_shard(d, m.unit),) + spec[a + 1:], shape, ms)

    def bad(why: str) -> PlanMismatchError:
        return _mismatch(where, f"{m.kind} along mesh axis {a} (dims {m.src_dim}, {m.dst_dim}) on spec "
                         f"{_fmt(spec, shape)}: {why}")

    gathers = m.kind in ("all_gather", "all_to_all")
    if gathers and not (isinstance(p, Shard) and p.dim == m.src_dim and shard_axes(spec, m.src_dim)[-1] == a):
        raise bad(f"mesh axis {a} must be the last one splitting dim {m.src_dim}")
    if m.kind == "all_gather" and m.dst_dim is None:
        return spec[:a] + (R,) + spec[a + 1:]
    if m.kind == "all_to_all" and m.dst_dim != m.src_dim and appendable(m.dst_dim) and loc[m.dst_dim] % ms[a] == 0 \
            and not uneven_dims(shape, spec, ms):
        return spec[:a] + (_shard(m.dst_dim, m.unit),) + spec[a + 1:]
    if m.kind in ("slice", "reduce_scatter") and m.src_dim is None and appendable(m.dst_dim):
        if p != (R if m.kind == "slice" else P):
            raise bad("the axis must be " + ("replicated" if m.kind == "slice" else "partial"))
        return spec[:a] + (_shard(m.dst_dim, m.unit),) + spec[a + 1:]
    if m.kind == "all_reduce" and (m.src_dim, m.dst_dim) == (None, None):
        if p != P:
            raise bad("the axis must be partial")
        return spec[:a] + (R,) + spec[a + 1:]
    if m.kind == "mask" and (m.src_dim, m.dst_dim) == (None, None):
        if p != R or not is_float:
            raise bad("the axis must be replicated and the tensor floating point")
        return spec[:a] + (P,) + spec[a + 1:]
    raise bad("the dims do not fit this move (a target dim must exist, differ from the source, be split on "
              "earlier axes only and be cut validly: evenly, or unevenly by this axis alone and never by an "
              "all-to-all)")


def _shard(d: int | None, unit: int = 1):
    return shard(d, unit) if d is not None else None


def _check_checkpoint(plan: Plan, gm: fx.GraphModule) -> None:
    """The plan's checkpoint stages are the graph's chain: one stage per sub-layer run, or
    one per layer (:func:`~autoparallel.solver.remat.chain_stages`, ``per_layer``)."""
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    have = plan.checkpoint.stages
    per_layer = {n.name: s for n, s in chain_stages(nodes, per_layer=True).items()}
    want = per_layer if have == per_layer else {n.name: s for n, s in chain_stages(nodes).items()}
    for name, s in want.items():
        if have.get(name) != s:
            raise _mismatch(f"checkpoint stages[{name!r}]", "the stage the graph's chain gives", s, have.get(name))
    extra = [k for k in have if k not in want]
    if extra:
        raise _mismatch(f"checkpoint stages[{extra[0]!r}]", "the graph's chain has no such node")
