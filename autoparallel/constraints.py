"""Constraints: pin the placement of named tensors and plan the rest around them.

``constraints={pattern: placements}`` (in :func:`autoparallel.plan` and
:func:`autoparallel.autoparallelize`) keeps, for every tensor a pattern matches, only the
strategies that give it those placements; the ILP then plans everything else around them.

Patterns are :mod:`fnmatch` globs (``*`` also crosses dots) over the names of

* parameters and buffers: every name of the tensor, tied names included
  (``transformer.h.*.attn.c_attn.weight``, ``lm_head.weight``);
* module paths: the output of the module, i.e. the value its last op hands to code outside
  the module (``model.layers.*.mlp``);
* inputs: the graph's placeholders, named after the keyword (``input_ids``) or the
  argument; an input is the global batch on every device (DESIGN §2), so its constraint
  applies to how each op that reads it takes it (``"S0(dp)"``: the batch is split over dp);
* outputs: the leaves of the model's output, named by their key path (``loss``,
  ``logits``, ``0`` for a tuple's first element); the constraint is the placement the
  output is computed in.

A pattern applies to every tensor it matches; one that matches nothing, two that pin one
tensor differently, and a placement the tensor has no strategy for raise
:class:`ConstraintError`.

Placement grammar (the plan's notation with mesh-axis names, as :func:`~autoparallel.placement.format_spec` prints)::

    placements := item (" " item)*
    item       := kind ["(" axis ")"]
    kind       := "R" | "P" | "S" dim ["u" unit]
    dim        := the tensor dim split, an int >= 0
    unit       := rows per unit of a split in units, an int >= 2
    axis       := a mesh axis name ("tp") or index ("1")

``S2u8(tp)`` is a split in whole units of 8 rows (:class:`~autoparallel.placement.UnitShard`:
25 heads of 8 columns on 2 devices are 104 and 96 columns), as ``str(plan)``,
``plan.table()`` and ``plan.explain()`` print it; it is legal only where
:func:`~autoparallel.placement.spec_problem` accepts it for the tensor's shape (the unit
divides the dim, the mesh axis does not divide its units, one mesh axis, no device left
empty), and never for a parameter or buffer, which DTensor stores (such a pin lists the
tensor's legal placements).

Either every item names its mesh axis, and the axes not named are replicated
(``"S0(tp)"`` on a ("dp", "tp") mesh is ``(Replicate(), Shard(0))``; ``"S0(dp) S0(tp)"``
splits dim 0 over both, dp outermost), or none does and there is one item per mesh axis
in mesh order (``"S0 R"``). ``"R"`` alone is replicated on every axis. A DTensor
placement tuple (``(Shard(0), Replicate())``, one per mesh axis) is accepted as well.

``"STORED -> USED"`` pins a tensor's placement and how every op that reads it takes it:
``"S0(dp) -> R"`` keeps a parameter split over dp and all-gathered for compute (FSDP);
without ``->`` the planner chooses how it is read (and where a mixed-precision policy's cast
runs). The nodes the capture adds between a parameter and the ops of the model are not such
ops: under a policy the parameter's cast to ``param_dtype`` runs on the stored placement
(FSDP2 casts the shard) and ``USED`` is how the ops take the cast copy (``"S0(dp) -> R"``
all-gathers ``param_dtype`` bytes, as FSDP2 does);
a fused projection's slices (:mod:`autoparallel.tracer.fused`) run on the stored placement
where they can (it does not split the sliced dim) and ``USED`` is how the products take
each part.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from .errors import AutoParallelError
from .graph import tensor_inputs
from .mesh import MeshSpec
from .placement import P, R, Spec, format_spec, shard, spec_problem, spec_to_json, unit_of

_ITEM = re.compile(r"(R|P|S(0|[1-9][0-9]*)(?:u([2-9]|[1-9][0-9]+))?)(?:\(([^()\s]+)\))?")


class ConstraintError(AutoParallelError, ValueError):
    """A constraint that cannot be applied: bad placement text, a pattern matching no
    tensor, two patterns pinning one tensor differently, or a placement the tensor has no
    strategy for (the message names the pattern, the tensor and its legal placements)."""


def parse_spec(text: str, axis_names: Sequence[str]) -> Spec:
    """The spec that placement text ``text`` denotes on a mesh with ``axis_names`` (grammar
    in the module docstring).

    Raises:
        ConstraintError: text that does not follow the grammar, an unknown or repeated mesh
            axis, or a positional list of the wrong length.
    """
    names = list(axis_names)
    items = text.split()
    if not items:
        raise ConstraintError(f"empty placement text {text!r}: write e.g. 'S0({names[-1]})' or 'R'")
    parsed = []
    for item in items:
        m = _ITEM.fullmatch(item)
        if m is None:
            raise ConstraintError(f"bad placement {item!r} in {text!r}: expected R, P, S<dim> or S<dim>u<unit> "
                                  "(unit >= 2, no leading zeros), optionally followed by a mesh axis in "
                                  f"parentheses, one of {names} or its index")
        if m.group(2) is not None:
            kind = shard(int(m.group(2)), int(m.group(3) or 1))
        else:
            kind = R if m.group(1) == "R" else P
        parsed.append((kind, m.group(4)))
    if items == ["R"]:
        return (R,) * len(names)
    named = [axis is not None for _, axis in parsed]
    if all(named):
        out = [R] * len(names)
        seen = set()
        for kind, axis in parsed:
            a = _axis(axis, names, text)
            if a in seen:
                raise ConstraintError(f"mesh axis {names[a]!r} placed twice in {text!r}")
            seen.add(a)
            out[a] = kind
        return tuple(out)
    if any(named):
        raise ConstraintError(f"{text!r} names the mesh axis of some items only: name every axis "
                              f"(e.g. 'S0({names[-1]})') or none (one item per axis of {names}, in order)")
    if len(parsed) != len(names):
        raise ConstraintError(f"{text!r} has {len(parsed)} placements for the {len(names)}-axis mesh {names}: "
                              "give one per axis in order, or name the axes, e.g. "
                              f"'S0({names[-1]})'")
    return tuple(kind for kind, _ in parsed)


def _axis(axis: str, names: list[str], text: str) -> int:
    if axis in names:
        return names.index(axis)
    if axis.isdigit() and int(axis) < len(names):
        return int(axis)
    raise ConstraintError(f"unknown mesh axis {axis!r} in {text!r}: the mesh axes are {names} "
                          f"(or their indices 0..{len(names) - 1})")


def as_spec(value, mesh: MeshSpec, pattern: str) -> Spec:
    """The spec of one constraint's value: placement text or a DTensor placement tuple.

    Raises:
        ConstraintError: a value of another type, a tuple of the wrong length or with
            entries that are not DTensor placements, or bad text (:func:`parse_spec`);
            the message names ``pattern``.
    """
    if isinstance(value, str):
        try:
            return parse_spec(value, mesh.axis_names)
        except ConstraintError as e:
            raise ConstraintError(f"constraint {pattern!r}: {e}") from None
    if isinstance(value, (tuple, list)) and all(isinstance(p, Placement) for p in value):
        if len(value) != mesh.ndim:
            raise ConstraintError(f"constraint {pattern!r}: {len(value)} placements for the {mesh.ndim}-axis "
                                  f"mesh {list(mesh.axis_names)}")
        if not all(isinstance(p, (Shard, Replicate, Partial)) for p in value):
            raise ConstraintError(f"constraint {pattern!r}: placements must be Shard, Replicate or Partial, "
                                  f"not {list(value)}")
        return tuple(shard(p.dim, unit_of(p)) if isinstance(p, Shard) else (P if isinstance(p, Partial) else R)
                     for p in value)
    raise ConstraintError(f"constraint {pattern!r}: placements must be text such as 'S0({mesh.axis_names[-1]})' "
                          f"or a tuple of DTensor placements, not {value!r}")


@dataclass(frozen=True)
class Target:
    """A tensor constraints can name.

    Attributes:
        kind: ``"parameter"``, ``"buffer"``, ``"module"`` (a module's output), ``"input"``
            or ``"output"``.
        names: the names patterns are matched against (a parameter's tied names too).
        node: the graph node of the value (a placeholder for an input).
    """

    kind: str
    names: tuple[str, ...]
    node: fx.Node

    @property
    def label(self) -> str:
        return f"{self.kind} {self.names[0]}"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.node.meta["val"].shape)


@dataclass(frozen=True)
class Pinned:
    """One resolved constraint: ``target`` must be placed ``spec`` and, when ``use`` is
    given, read as ``use`` by every op that reads it; asked by ``pattern``."""

    pattern: str
    target: Target
    spec: Spec
    use: Spec | None = None

    def text(self, axis_names) -> str:
        return format_spec(self.spec, axis_names) + (f" -> {format_spec(self.use, axis_names)}" if self.use else "")


def targets(traced) -> list[Target]:
    """Every tensor of a traced model (:class:`~autoparallel.tracer.capture.TracedModel`)
    that a constraint can name, in graph order within each kind."""
    gm = traced.gm
    out = []
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in traced.params:
            out.append(Target("parameter", tuple(traced.params[node.target]), node))
        elif node.op == "get_attr" and node.target in traced.buffers:
            out.append(Target("buffer", tuple(traced.buffers[node.target]), node))
        elif node.op == "placeholder" and _is_tensor(node):
            out.append(Target("input", (node.name,), node))
    out += [Target("module", (path,), node) for path, node in module_outputs(gm).items()]
    out += [Target("output", (name,), node) for name, node in _outputs(traced)]
    return out


def module_outputs(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """Module path → the node whose value the module returns: the last op inside the module
    (its path or a sub-path of it) with a user outside it."""
    out: dict[str, fx.Node] = {}
    for node in gm.graph.nodes:
        path = _path(node)
        if node.op != "call_function" or not path or not _is_tensor(node):
            continue
        parts = path.split(".")
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            if any(not _inside(_path(u), prefix) for u in node.users):
                out[prefix] = node
    return out


def _outputs(traced) -> list[tuple[str, fx.Node]]:
    """(key path, node) of the user's output leaves that are tensors."""
    out_node = next(n for n in traced.gm.graph.nodes if n.op == "output")
    flat = pytree.tree_leaves(out_node.args[0])
    n_user = traced.out_spec.num_leaves
    tree = pytree.tree_unflatten(list(range(n_user)), traced.out_spec)
    names = {}
    for path, i in pytree.tree_flatten_with_path(tree)[0]:
        names[i] = ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
    return [(names[i] or str(i), x) for i, x in enumerate(flat[:n_user]) if isinstance(x, fx.Node) and _is_tensor(x)]


def _path(node: fx.Node) -> str:
    info = node.meta.get("autoparallel")
    return getattr(info, "module_path", "") or "" if info is not None else ""


def _inside(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def check_type(constraints) -> None:
    """Check, before any tracing, that ``constraints`` maps glob patterns (str) to placements.

    Raises:
        TypeError: ``constraints`` is not a mapping of string patterns.
    """
    if not isinstance(constraints, Mapping) or not all(isinstance(k, str) for k in constraints):
        raise TypeError(f"constraints must be a dict of glob pattern (str) -> placements, not {constraints!r}")


def resolve(constraints: Mapping[str, object], traced, mesh: MeshSpec) -> list[Pinned]:
    """Match every pattern of ``constraints`` against the tensors of ``traced``.

    Returns:
        one :class:`Pinned` per (pattern, matched tensor).

    Raises:
        ConstraintError: bad placements (:func:`as_spec`), a pattern matching nothing (the
            message names the closest names and layer globs), or a tensor two patterns pin
            differently.
        TypeError: ``constraints`` is not a mapping of string patterns.
    """
    check_type(constraints)
    all_targets = targets(traced)
    pinned: list[Pinned] = []
    by_node: dict[tuple[str, fx.Node], Pinned] = {}
    for pattern, value in constraints.items():
        spec, use = _stored_and_used(value, mesh, pattern)
        hits = [t for t in all_targets if any(fnmatch.fnmatchcase(n, pattern) for n in t.names)]
        if not hits:
            raise ConstraintError(f"constraint {pattern!r} matches no parameter, buffer, module, input or output "
                                  f"name; {_closest(pattern, all_targets)}")
        for t in hits:
            _check_legal(pattern, t, spec, use, mesh)
            key = (t.kind == "input", t.node)
            p = Pinned(pattern, t, spec, use)
            other = by_node.get(key)
            if other is not None and (other.spec, other.use) != (spec, use):
                raise ConstraintError(
                    f"{t.label} is pinned to {other.text(mesh.axis_names)} by {other.pattern!r} and "
                    f"to {p.text(mesh.axis_names)} by {pattern!r}: make the patterns disjoint")
            by_node[key] = p
            pinned.append(p)
    return pinned


def _check_legal(pattern: str, t: Target, spec: Spec, use: Spec | None, mesh: MeshSpec) -> None:
    """Raise ConstraintError when ``spec`` (or ``use``) splits ``t`` in units that cannot place
    its shape on ``mesh`` (:func:`~autoparallel.placement.spec_problem`), or would store a
    parameter or buffer in a split in units. (A plain placement no strategy has is reported
    with the tensor's legal placements by :func:`restrict`.)"""
    for s in (spec, use):
        has_units = s is not None and any(unit_of(p) > 1 for p in s)
        why = spec_problem(s, t.shape, mesh.shape) if has_units else None
        if why:
            raise ConstraintError(f"constraint {pattern!r}: {t.label} {list(t.shape)} cannot be placed "
                                  f"{format_spec(s, mesh.axis_names)}: that placement {why}")
    if t.kind in ("parameter", "buffer") and any(unit_of(p) > 1 for p in spec):
        raise ConstraintError(f"constraint {pattern!r}: {t.label} cannot be stored {format_spec(spec, mesh.axis_names)}: "
                              "parameters and buffers are DTensors, which hold no split in units; pin it "
                              "replicated or split plainly (the ops reading it may still cut it in units)")


def _stored_and_used(value, mesh: MeshSpec, pattern: str) -> tuple[Spec, Spec | None]:
    """``(placement, use)`` of a constraint value: ``"STORED -> USED"`` text gives both."""
    if isinstance(value, str) and "->" in value:
        stored, _, used = value.partition("->")
        return as_spec(stored, mesh, pattern), as_spec(used, mesh, pattern)
    return as_spec(value, mesh, pattern), None


_LAYER_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")


def _closest(pattern: str, all_targets: list[Target], n: int = 3) -> str:
    """``"closest: 'lm_head.weight', ..."``: the ``n`` names (or their layer globs, ``h.*.attn``)
    nearest ``pattern`` (:func:`difflib.get_close_matches`); else one example name per kind."""
    names = {name for t in all_targets for name in t.names}
    candidates = sorted(names | {_LAYER_INDEX.sub("*", name) for name in names})
    close = difflib.get_close_matches(pattern, candidates, n=n, cutoff=0.6)
    if close:
        return "closest: " + ", ".join(repr(c) for c in close)
    seen: dict[str, str] = {}
    for t in all_targets:
        seen.setdefault(t.kind, t.names[0])
    return "nothing close; for example " + ", ".join(f"{k} {v!r}" for k, v in seen.items())


def cache_key(pinned: list[Pinned]) -> dict[str, list]:
    """What the plan cache keys a set of resolved constraints by: tensor → spec (JSON)."""
    return {p.target.label: [spec_to_json(p.spec), spec_to_json(p.use) if p.use else None]
            for p in sorted(pinned, key=lambda p: p.target.label)}


def restrict(strategies: dict, aliases: dict, pinned: list[Pinned], axis_names: Sequence[str]) -> None:
    """Keep, for every pinned tensor, only the strategies that place it as pinned: those of
    its producer giving that output spec, or, for an input, those of every op reading it
    taking that input spec; with a ``use``, also those of every op reading it taking it so.
    With a ``use``, a parameter read through a mixed-precision policy's cast (:func:`policy_cast`)
    is cast where it is stored and ``use`` applies to the ops reading the cast, as FSDP2 orders it
    (cast the shard, then all-gather in ``param_dtype``; docs/design.md, "Mixed precision");
    one read in slices (a fused projection) is sliced where it is stored when the slices can
    run there, and ``use`` applies to the ops reading the parts (each part gathered, not the
    whole tensor once per part).

    Raises:
        ConstraintError: when no strategy places a tensor as pinned, naming the pattern, the
            tensor, its shape and the placements it can have.
    """
    for p in pinned:
        if p.target.kind == "input":
            _keep_readers(strategies, p, p.spec, axis_names)
            continue
        node, idx = aliases.get(p.target.node, (p.target.node, 0))
        if node in strategies:
            _keep(strategies, node, p, p.spec, axis_names, lambda s, idx=idx: s.outputs[idx], "")
        if p.use is None:
            continue
        read = p.target.node
        cast = policy_cast(read) if p.target.kind == "parameter" else None
        if cast is not None and cast in strategies:  # FSDP2's order: cast the stored shard, gather the cast copy
            _keep(strategies, cast, p, p.spec, axis_names, lambda s: s.inputs[0], f"as read by its cast {cast.name}")
            read = cast
        parts = _parts_on_the_shard(strategies, read, p.spec) if p.target.kind == "parameter" else []
        for part in parts:  # a fused projection's parts sliced from the stored shard, each read as `use`
            _keep(strategies, part, p, p.spec, axis_names, lambda s: s.inputs[0], f"as read by its slice {part.name}")
        for r in parts or [read]:
            _keep_readers(strategies, p, p.use, axis_names, r)


def _parts_on_the_shard(strategies, read: fx.Node, spec: Spec) -> list[fx.Node]:
    """The slices ``read`` (a parameter or its cast) is read through when every op reading it is
    a slice (a fused projection split into parts, :mod:`autoparallel.tracer.fused`) that can
    run on ``spec``, the stored placement (one not splitting the sliced dim); else ``[]``."""
    users = list(read.users)
    if not users or any(u.target is not torch.ops.aten.slice.Tensor or u not in strategies for u in users):
        return []
    return users if all(any(tuple(s.inputs[0]) == spec for s in strategies[u]) for u in users) else []


def policy_cast(param: fx.Node) -> fx.Node | None:
    """The ``aten._to_copy`` a mixed-precision policy reads parameter ``param`` through (its
    only user, :mod:`autoparallel.tracer.casts`), or ``None``."""
    users = list(param.users)
    return users[0] if len(users) == 1 and users[0].target is torch.ops.aten._to_copy.default else None


def read_through(param: fx.Node) -> list[fx.Node]:
    """The nodes parameter ``param`` (a ``get_attr``) is read through before compute: its
    mixed-precision cast (:func:`policy_cast`) and the slices of it or of its cast (a fused
    projection split into parts, :mod:`autoparallel.tracer.fused`), in graph order."""
    cast = policy_cast(param)
    read = cast or param
    return ([cast] if cast is not None else []) + [u for u in read.users if u.target is torch.ops.aten.slice.Tensor]


def _keep_readers(strategies, p: Pinned, spec: Spec, axis_names, read: fx.Node | None = None) -> None:
    """Keep the strategies of every op reading ``read`` (default: the pinned tensor) that take
    it as ``spec``."""
    read = p.target.node if read is None else read
    for user in read.users:
        if user not in strategies:
            continue
        for j, (_, x) in enumerate(tensor_inputs(user)):
            if x is read:
                _keep(strategies, user, p, spec, axis_names, lambda s, j=j: s.inputs[j], f"as read by {user.name}")


def _keep(strategies, node, p: Pinned, spec: Spec, axis_names, spec_of, how: str) -> None:
    kept = [s for s in strategies[node] if tuple(spec_of(s)) == spec]
    if not kept:
        legal = sorted({format_spec(spec_of(s), axis_names) for s in strategies[node]})
        raise ConstraintError(
            f"constraint {p.pattern!r}: {p.target.label} {list(p.target.shape)} {how + ' ' if how else ''}cannot be "
            f"placed {format_spec(spec, axis_names)}; its legal placements are: {', '.join(legal)}")
    strategies[node] = kept
