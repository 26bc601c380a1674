"""Redistribution: the cheapest sequence of one-step moves between two specs.

Moves, each along one mesh axis ``a``:

=================  =====================  ==============  ===========================
move               from → to (on axis a)  forward         backward
=================  =====================  ==============  ===========================
``all_gather``     S(d) → R               all-gather      reduce-scatter
``all_to_all``     S(d) → S(d')           all-to-all      all-to-all
``slice``          R → S(d)               local chunk     none (partial gradient)
``all_reduce``     P → R                  all-reduce      all-reduce
``reduce_scatter`` P → S(d)               reduce-scatter  all-gather
``mask``           R → P                  keep on coord 0 none
=================  =====================  ==============  ===========================

A dim split over several axes is split in ascending axis order, so only its last axis
can be gathered and a new axis can only be appended after the existing ones. A dim may be
split unevenly by one axis (:mod:`autoparallel.placement`, "Uneven splits"): slices,
reduce-scatters and all-gathers reach and leave such specs (the emitter pads the pieces to
equal size around the collective); all-to-alls do not, on any tensor with an uneven dim
(their split sizes would differ by device), and bytes are those of the largest shard. A cut in
units (:class:`~autoparallel.placement.UnitShard`) is reached by a slice or reduce-scatter
that carries the unit (``Move.unit``) and left by an all-gather; the search offers it only
where the target spec has it (a cut in units no op asked for is never useful). Gradients
of replicated tensors are carried as per-device partial sums (DESIGN §2), which is why a
slice needs no backward collective. The search is Dijkstra's algorithm over specs with
each move weighted by its forward and (when a gradient flows) backward cost, run once
per (shape, dtype, source) and memoized.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from torch.distributed.tensor import Partial, Replicate, Shard

from ..placement import P, R, Spec, is_valid, local_shape, shard, shard_axes, uneven_dims, unit_of
from ..plan import Move
from .costs import CostModel

@dataclass
class SpecGraph:
    """The specs a tensor can take and the one-step moves between them (:meth:`Redistributor.graph`).

    Attributes:
        specs: the specs; ``specs[0]`` is the replicated one.
        index: spec → its position in ``specs``.
        arcs: ``(i, j, move)``: ``move`` turns ``specs[i]`` into ``specs[j]``.
    """

    specs: list[Spec]
    index: dict[Spec, int]
    arcs: list[tuple[int, int, Move]]


_CONJUGATE = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather", "all_to_all": "all_to_all",
              "all_reduce": "all_reduce"}
_LOCAL_MOVE_COST = 1e-9  # local slices/masks are free but should not be taken for nothing


class Redistributor:
    """Memoized shortest redistribution paths between specs of tensors of one mesh.

    Args:
        cost_model: a bound :class:`CostModel` (its mesh gives axis sizes, alpha, beta).
    """

    def __init__(self, cost_model: CostModel):
        self.cm = cost_model
        self.mesh_shape = cost_model.mesh.shape
        self._memo: dict = {}
        self._graphs: dict = {}
        self._distances: dict = {}

    def _neighbors(self, spec: Spec, shape, itemsize: int, is_float: bool, units: frozenset):
        ms = self.mesh_shape
        loc = local_shape(shape, spec, ms)
        nbytes = itemsize
        for s in loc:
            nbytes *= s
        even = not uneven_dims(shape, spec, ms)

        def splits(a: int, d: int):
            """``(unit, spec)`` with dim ``d`` split along axis ``a`` after its other axes, plainly
            or in one of ``units`` of ``d``, where valid."""
            axes = shard_axes(spec, d)
            if axes and axes[-1] >= a:
                return
            for u in (1, *sorted(u for d2, u in units if d2 == d)):
                new = spec[:a] + (shard(d, u),) + spec[a + 1:]
                if is_valid(new, shape, ms):
                    yield u, new

        for a, p in enumerate(spec):
            n = ms[a]
            if n == 1:
                continue
            if isinstance(p, Shard):
                d = p.dim
                if shard_axes(spec, d)[-1] != a:
                    continue
                yield Move("all_gather", a, d, None, nbytes * n), spec[:a] + (R,) + spec[a + 1:]
                for d2 in range(len(shape)):
                    axes2 = shard_axes(spec, d2)
                    if even and d2 != d and (not axes2 or axes2[-1] < a) and loc[d2] % n == 0:
                        yield Move("all_to_all", a, d, d2, nbytes), spec[:a] + (Shard(d2),) + spec[a + 1:]
            elif isinstance(p, Replicate):
                for d in range(len(shape)):
                    for u, new in splits(a, d):
                        yield Move("slice", a, None, d, 0, u), new
                if is_float:
                    yield Move("mask", a, None, None, 0), spec[:a] + (P,) + spec[a + 1:]
            elif isinstance(p, Partial):
                yield Move("all_reduce", a, None, None, nbytes), spec[:a] + (R,) + spec[a + 1:]
                for d in range(len(shape)):
                    for u, new in splits(a, d):
                        yield Move("reduce_scatter", a, None, d, nbytes, u), new

    def move_cost(self, m: Move, requires_grad: bool) -> float:
        """Forward (+ backward when a gradient flows) seconds of one move."""
        if m.kind in ("slice", "mask"):
            return _LOCAL_MOVE_COST
        t = self.cm.collective_time(m.kind, m.axis, m.nbytes)
        if requires_grad:
            t += self.cm.collective_time(_CONJUGATE[m.kind], m.axis, m.nbytes)
        return t

    def paths_from(self, shape: Sequence[int], itemsize: int, is_float: bool, src: Spec,
                   requires_grad: bool, units: frozenset = frozenset()) -> dict[Spec, tuple[float, tuple[Move, ...]]]:
        """Cheapest cost and moves from ``src`` to every reachable spec; cuts in units only as
        ``units`` (pairs of tensor dim and rows per unit) offers them."""
        key = (tuple(shape), itemsize, is_float, src, requires_grad, units)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        best: dict[Spec, tuple[float, tuple[Move, ...]]] = {src: (0.0, ())}
        counter = itertools.count()
        heap = [(0.0, next(counter), src)]
        done = set()
        while heap:
            cost, _, spec = heapq.heappop(heap)
            if spec in done:
                continue
            done.add(spec)
            path = best[spec][1]
            for move, nxt in self._neighbors(spec, shape, itemsize, is_float, units):
                c = cost + self.move_cost(move, requires_grad)
                if nxt not in best or c < best[nxt][0] - 1e-15:
                    best[nxt] = (c, path + (move,))
                    heapq.heappush(heap, (c, next(counter), nxt))
        self._memo[key] = best
        return best

    def graph(self, shape: Sequence[int], itemsize: int, is_float: bool, units: frozenset = frozenset()) -> SpecGraph:
        """Every spec reachable from the replicated one and every move between two of them, for
        tensors of ``shape`` (memoized; ``units`` as in :meth:`paths_from`)."""
        key = (tuple(shape), itemsize, is_float, units)
        hit = self._graphs.get(key)
        if hit is not None:
            return hit
        specs = [tuple(R for _ in self.mesh_shape)]
        index = {specs[0]: 0}
        arcs = []
        for i, spec in enumerate(specs):  # grows while it is walked: a breadth-first search
            for move, nxt in self._neighbors(spec, shape, itemsize, is_float, units):
                if nxt not in index:
                    index[nxt] = len(specs)
                    specs.append(nxt)
                arcs.append((i, index[nxt], move))
        graph = self._graphs[key] = SpecGraph(specs, index, arcs)
        return graph

    def distances(self, shape: Sequence[int], itemsize: int, is_float: bool, requires_grad: bool,
                  units: frozenset = frozenset()) -> tuple[SpecGraph, np.ndarray, np.ndarray]:
        """The spec graph of :meth:`graph`, the cheapest seconds between every two of its specs,
        ``d[i, j]`` from ``specs[i]`` to ``specs[j]`` (``inf`` when unreachable): the costs of
        :meth:`paths_from`, all pairs at once by the Floyd-Warshall algorithm (Floyd, "Algorithm
        97: Shortest path", CACM 1962) in numpy; and the seconds of each of its arcs
        (:meth:`move_cost`). Memoized."""
        key = (tuple(shape), itemsize, is_float, requires_grad, units)
        hit = self._distances.get(key)
        if hit is not None:
            return hit
        g = self.graph(shape, itemsize, is_float, units)
        n = len(g.specs)
        c = np.array([self.move_cost(move, requires_grad) for _, _, move in g.arcs])
        d = np.full((n, n), np.inf)
        for (i, j, _), cost in zip(g.arcs, c.tolist()):
            d[i, j] = min(d[i, j], cost)
        np.fill_diagonal(d, 0.0)
        for k in range(n):
            np.minimum(d, d[:, k, None] + d[None, k, :], out=d)
        self._distances[key] = g, d, c
        return g, d, c

    def cost(self, shape, itemsize, is_float, src: Spec, dst: Spec, requires_grad: bool) -> float:
        """Seconds of the cheapest redistribution (:meth:`redistribute`'s, from :meth:`distances`);
        ``inf`` when impossible."""
        if src == dst:
            return 0.0
        units = frozenset((p.dim, unit_of(p)) for p in dst if unit_of(p) > 1)
        g, d, _ = self.distances(shape, itemsize, is_float, requires_grad, units)
        i, j = g.index.get(src), g.index.get(dst)
        if i is None or j is None:  # a spec that the replicated one does not reach
            return self.redistribute(shape, itemsize, is_float, src, dst, requires_grad)[0]
        return float(d[i, j])

    def redistribute(self, shape, itemsize, is_float, src: Spec, dst: Spec, requires_grad: bool
                ) -> tuple[float, tuple[Move, ...]]:
        """``(seconds, moves)`` of the cheapest redistribution; ``(inf, ())`` when impossible."""
        if src == dst:
            return 0.0, ()
        units = frozenset((p.dim, unit_of(p)) for p in dst if unit_of(p) > 1)
        return self.paths_from(shape, itemsize, is_float, src, requires_grad, units).get(dst, (float("inf"), ()))
