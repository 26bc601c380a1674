"""The rule engine: enumerate an op's strategies from a description of its dims.

An op is described by a :class:`DimMap`: one label per dim of every tensor input and
output (``None`` for a dim that may not be split: a broadcast dim of size 1, a dim the op
normalizes or slices over). A label shared by inputs and output is a parallel dim:
splitting it splits all those tensors alike. A label in ``reduce`` appears in inputs
only and is summed over (the ``k`` of a matmul): splitting it leaves each device with a
partial sum, so the output is ``Partial`` (and inputs that lack the label, e.g. a bias
added after the sum, must be ``Partial`` too). ``partial`` lists linear sets: sets of inputs
in which the op is linear: when exactly those inputs are ``Partial`` along a mesh axis (the
rest replicated), the output is ``Partial`` along it.

Enumeration assigns to every mesh axis either nothing, one label, or one linear set,
and keeps assignments where every split dim divides evenly, or, for ops whose local form is
exact on ``torch.chunk`` pieces (``DimMap.uneven``), where a label of the same size in every
tensor is split unevenly by one mesh axis (:mod:`autoparallel.placement`, "Uneven splits"), or
in units (:class:`~autoparallel.placement.UnitShard`): a label whose dims are whole numbers of
units of their own sizes, the same number in every tensor (``DimMap.units``: a view's
``[B, S, 200] → [B, S, 25, 8]`` cuts 200 in units of 8 where it cuts 25 in heads), or a label
of one size ``s`` cut in a unit the caller offers for ``s`` (``unit_candidates``, from the
graph's views), so that a projection's output is cut in the heads its consumer's view needs.
This is the einsum view of sharding that Alpa (arXiv 2201.12023, §4.1) and the SPMD partitioners build on; one
engine covers matmuls, pointwise ops, views and reductions.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from ..placement import P, R, Spec, chunk_ok, shard

Label = Hashable


@dataclass(frozen=True)
class Strategy:
    """One way to run an op on the mesh.

    Attributes:
        inputs: the spec each tensor input must have, in the order of
            :func:`autoparallel.strategies.tensor_inputs`.
        outputs: the spec of each tensor output.
        split: how many ways the op's work is divided (global FLOPs / the largest device's
            FLOPs; not an integer when a dim is split unevenly).
        offload: for a trainable parameter, whether its shard, gradient and optimizer states
            are held in host memory and the optimizer steps it there
            (:mod:`autoparallel.strategies.offload`).
        zero: for a trainable parameter replicated along mesh axes, the axes over which its
            optimizer states are sharded while compute reads it whole (ZeRO stage 1,
            :mod:`autoparallel.strategies.zero`); ``()``: not sharded.
        zero_grad: with ``zero``, the gradient is reduce-scattered onto the shard instead of
            all-reduced whole (ZeRO stage 2).
    """

    inputs: tuple[Spec, ...]
    outputs: tuple[Spec, ...]
    split: int | float = 1
    offload: bool = False
    zero: tuple[int, ...] = ()
    zero_grad: bool = False


@dataclass
class DimMap:
    """Dim labels of an op's tensor inputs and outputs (see module docstring).

    Attributes:
        inputs / outputs: per tensor, one label (or ``None``) per dim.
        in_shapes / out_shapes: the global shapes, used for the divisibility check.
        reduce: labels summed over by the op.
        partial: linear sets: tuples of input positions in which the op is linear.
        factors: input positions that scale the summed terms (a class weight, a loss
            weight): replicated along a split ``reduce`` label they lack, where a bias
            added after the sum would be ``Partial``.
        blocks: label → a count the label's number of pieces must divide as well as its
            dims' sizes (``group_norm``'s channels split by whole groups).
        uneven: how many dims of each tensor may be split unevenly: 0 (the default) for ops
            whose local form assumes equal pieces; a ``view`` takes 1 (its local size
            argument holds ``-1`` for that dim), ops with no size argument any number. An
            op with inputs splits unevenly only labels some input has (an ``expand``ed
            broadcast dim has no input to take its local, device-dependent size from).
        uneven_labels: when given, only these labels may be split unevenly (a loss's
            classes, not its batch: ``nll_loss`` on per-device batch sizes does not run
            under simulated ranks, so those strategies could not be verified).
        units: label → {size: rows per unit} for a label whose dims differ in size but are
            the same number of units (a view's split or merged dim): the only uneven cut of
            such a label cuts every dim in its units. Sizes absent: a unit of 1.
    """

    inputs: list[tuple[Label | None, ...]]
    outputs: list[tuple[Label | None, ...]]
    in_shapes: list[tuple[int, ...]]
    out_shapes: list[tuple[int, ...]]
    reduce: frozenset = frozenset()
    partial: list[frozenset[int]] = field(default_factory=list)
    factors: frozenset[int] = frozenset()
    blocks: dict = field(default_factory=dict)
    uneven: int = 0
    uneven_labels: frozenset | None = None
    units: dict = field(default_factory=dict)


def _spec_for(labels: Sequence[Label | None], shape, assign: Sequence, units: dict, reduce: frozenset,
              is_input: bool, pos: int, factors: frozenset = frozenset()) -> Spec | None:
    spec = []
    for kind, val in assign:
        if kind is None:
            spec.append(R)
        elif kind == "label":
            if val in labels:
                d = labels.index(val)
                spec.append(shard(d, units.get(val, {}).get(shape[d], 1)))
            elif val in reduce:
                spec.append(R if is_input and pos in factors else P)
            elif is_input:
                spec.append(R)
            else:
                return None  # an output cannot be replicated over a split dim it lacks
        else:  # a linear set: Partial in, Partial out
            spec.append(P if (not is_input or pos in val) else R)
    return tuple(spec)


def _pieces(mesh_shape: Sequence[int], assign: Sequence, label: Label) -> int:
    """Into how many pieces ``assign`` splits ``label``."""
    return math.prod(mesh_shape[a] for a, (k, v) in enumerate(assign) if k == "label" and v == label)


def enumerate_strategies(dm: DimMap, mesh_shape: Sequence[int],
                         unit_candidates: dict[int, Sequence[int]] | None = None) -> list[Strategy]:
    """Every strategy of the op described by ``dm`` on a mesh of ``mesh_shape``.

    Args:
        unit_candidates: size → rows per unit a label of that one size may also be cut in
            (by one mesh axis, where the cut is uneven in units; module docstring).
    """
    labels = []
    for labs in dm.inputs + dm.outputs:
        for lab in labs:
            if lab is not None and lab not in labels:
                labels.append(lab)
    options = [(None, None)] + [("label", lab) for lab in labels] + [("partial", g) for g in dm.partial]
    tensors = list(zip(dm.inputs, dm.in_shapes)) + list(zip(dm.outputs, dm.out_shapes))
    in_labels = {lab for labs in dm.inputs for lab in labs}
    sizes: dict = {}  # label → the sizes of its dims
    for labs, shape in tensors:
        for lab, s in zip(labs, shape):
            if lab is not None:
                sizes.setdefault(lab, set()).add(s)
    result = []
    for assign in itertools.product(options, repeat=len(mesh_shape)):
        # a label must be split in ascending mesh-axis order; product() gives each set once
        if any(k is not None and mesh_shape[a] == 1 for a, (k, _) in enumerate(assign)):
            continue  # a mesh axis of size 1 only ever replicates (avoids duplicate strategies)
        if any(count % _pieces(mesh_shape, assign, lab) for lab, count in dm.blocks.items()):
            continue
        split = {lab: _pieces(mesh_shape, assign, lab) for lab in labels}
        split = {lab: n for lab, n in split.items() if n > 1}
        ways = [[(lab, *cut) for cut in _cuts(sizes[lab], dm.units.get(lab, {}), n,
                                              sum(1 for k, v in assign if k == "label" and v == lab),
                                              unit_candidates or {})] for lab, n in split.items()]
        for cuts in itertools.product(*ways):
            uneven = {lab for lab, _, is_uneven, _ in cuts if is_uneven}
            if any(dm.inputs and lab not in in_labels or dm.uneven_labels is not None and lab not in dm.uneven_labels
                   for lab in uneven) or dm.uneven < max(
                    (sum(lab in uneven for lab in labs) for labs, _ in tensors), default=0):
                continue
            units = {lab: u for lab, u, _, _ in cuts}
            ins = [_spec_for(labs, shape, assign, units, dm.reduce, True, i, dm.factors)
                   for i, (labs, shape) in enumerate(zip(dm.inputs, dm.in_shapes))]
            outs = [_spec_for(labs, shape, assign, units, dm.reduce, False, i)
                    for i, (labs, shape) in enumerate(zip(dm.outputs, dm.out_shapes))]
            if any(s is None for s in outs):
                continue
            result.append(Strategy(tuple(ins), tuple(outs), math.prod(work for _, _, _, work in cuts)))
    return result


def _cuts(sizes: set[int], base: dict[int, int], pieces: int, axes: int, candidates: dict) -> list[tuple]:
    """The ways to cut a label whose dims have ``sizes`` into ``pieces`` (by ``axes`` mesh
    axes), each ``(units, uneven, work)``: rows per unit by size (absent: 1), whether the cut
    is uneven, and the work split (global over the largest piece: ``pieces`` when even,
    ``K / ceil(K / pieces)`` for ``K`` units, a float a little less, when uneven). Even when
    ``pieces`` divides every size; unevenly only by one mesh axis, with every dim the same
    number of units (of ``base``, else of 1) and no device left empty (so that the pieces of
    all tensors correspond); and, for a label of one size, in each offered candidate unit
    that the pieces do not divide (even when they divide the size: 20 = 5 heads of 4 on 2
    devices is 12 and 8, besides 10 and 10)."""
    even = all(s % pieces == 0 for s in sizes)
    cuts = [({}, False, pieces)] if even else []
    if axes != 1:
        return cuts
    options = [] if even else [base]  # base: {} for a plain torch.chunk cut
    if len(sizes) == 1 and not base:
        s = next(iter(sizes))
        options += [{s: u} for u in candidates.get(s, ()) if s % u == 0 and (s // u) % pieces]
    for units in options:
        counts = {s // units.get(s, 1) for s in sizes}
        k = next(iter(counts))
        if len(counts) == 1 and all(s % units.get(s, 1) == 0 for s in sizes) and chunk_ok(k, pieces):
            cuts.append((units, True, k / -(-k // pieces)))
    return cuts
