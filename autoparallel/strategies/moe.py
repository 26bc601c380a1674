"""Records of the ops mixture-of-experts layers route tokens with: the token count per
expert (``histc``), scatter-adds of tokens into their rows (``scatter_add``,
``index_add``), and Hugging Face's grouped matmul over experts
(``transformers::grouped_mm_fallback``). The router's choice of experts (``topk``) and the
sort of tokens by expert are ops along one dim (:func:`.rules.along_dim_rule`).

``bincount`` has no record: its output length is the largest value plus one, which capture
cannot know before the run (:mod:`autoparallel.tracer.annotate` rejects such a node), so no
captured graph holds it; routers count tokens with ``histc`` over a fixed range instead.
"""

from __future__ import annotations

import torch

from ..graph import op_args
from .engine import DimMap
from .records import record
from .rules import _labels, _norm

aten = torch.ops.aten


@record(aten.histc.default)
def histc_rule(node, in_shapes, out_shapes):
    """``histc(x, bins, min, max)`` counts the elements of ``x`` (any shape, flattened) in
    ``bins`` equal bins over ``[min, max]``, each element on its own: a split ``x`` counts
    to the sum of its pieces' counts, so every dim of ``x`` may be split, leaving a
    ``Partial`` histogram (the bins stay whole). Only when ``max > min``: with ``min ==
    max`` (the default ``0, 0``) torch takes the range from the data's own minimum and
    maximum, which each piece would take from its own values, so nothing is split.
    (DTensor's registry offers the split whenever ``min`` and ``max`` are passed, ``0, 0``
    too.)"""
    a = op_args(node)
    nd = len(in_shapes[0])
    labs = _labels(nd) if a["max"] > a["min"] else (None,) * nd
    return DimMap([labs], [(None,)], list(in_shapes), list(out_shapes),
                  reduce=frozenset(lab for lab in labs if lab is not None))


@record(aten.scatter_add.default, aten.scatter_add_.default)
def scatter_add_rule(node, in_shapes, out_shapes):
    """``scatter_add(self, dim, index, src)``: the output is ``self`` with each
    ``src[..., j, ...]`` (``j`` along ``dim``) added at row ``index[..., j, ...]`` of ``dim``.

    - A dim other than ``dim`` on which ``self``, ``index`` and ``src`` have one size is
      parallel: each device scatters its own slices (``index`` and ``src`` may be smaller
      than ``self`` there, and ``src`` larger than ``index``: such a dim stays whole, as the
      pieces would not correspond).
    - ``dim`` of ``index`` and ``src`` (when of one size) may be split together: each device
      adds its share of the terms, a partial sum, so ``self`` is ``Partial`` (added once over
      the devices) and so is the output. ``dim`` of ``self`` stays whole: the indices
      address all of it.
    - The op is linear in ``self`` and ``src`` jointly: both ``Partial`` (``index`` whole)
      give a ``Partial`` output.

    The in-place ``scatter_add_`` writes its output into ``self``, with its spec."""
    x, idx, src = in_shapes
    nd = len(x)
    if nd == 0 or len(idx) != nd or len(src) != nd:  # 0-d operands: nothing to split
        return DimMap([(None,) * len(s) for s in in_shapes], [(None,) * nd], list(in_shapes), list(out_shapes))
    dim = _norm(op_args(node)["dim"], nd)
    labs = _labels(nd)
    lx = tuple(labs[d] if d != dim and x[d] == idx[d] == src[d] else None for d in range(nd))
    terms = "j" if idx[dim] == src[dim] else None
    li = tuple(terms if d == dim else lx[d] for d in range(nd))
    return DimMap([lx, li, li], [lx], list(in_shapes), list(out_shapes),
                  reduce=frozenset({terms} - {None}), partial=[frozenset({0, 2})])


@record(aten.index_add.default, aten.index_add_.default)
def index_add_rule(node, in_shapes, out_shapes):
    """``index_add(self, dim, index, source, alpha=a)``: the output is ``self`` with
    ``a · source.select(dim, j)`` added at ``self.select(dim, index[j])``.

    - Every dim other than ``dim`` is parallel (``source`` has ``self``'s size there).
    - ``index`` and ``dim`` of ``source`` may be split together: each device adds its share
      of the terms, a partial sum, so ``self`` is ``Partial`` and so is the output. ``dim``
      of ``self`` stays whole: the indices address all of it.
    - The op is linear in ``self`` and ``source`` jointly (``alpha`` scales ``source``
      only): both ``Partial`` (``index`` whole) give a ``Partial`` output.

    The in-place ``index_add_`` writes its output into ``self``, with its spec."""
    x, idx, src = in_shapes
    nd = len(x)
    if nd == 0 or len(idx) != 1 or len(src) != nd:  # 0-d operands: nothing to split
        return DimMap([(None,) * len(s) for s in in_shapes], [(None,) * nd], list(in_shapes), list(out_shapes))
    dim = _norm(op_args(node)["dim"], nd)
    lx = tuple(None if d == dim else lab for d, lab in enumerate(_labels(nd)))
    lsrc = tuple("j" if d == dim else lab for d, lab in enumerate(lx))
    return DimMap([lx, ("j",), lsrc], [lx], list(in_shapes), list(out_shapes),
                  reduce=frozenset({"j"}), partial=[frozenset({0, 2})])


@record("transformers.grouped_mm_fallback.default")
def grouped_mm_rule(node, in_shapes, out_shapes):
    """Hugging Face's grouped matmul, ``grouped_mm_fallback(input (S, K), weight (E, K, N),
    offs (E,))`` (transformers 5's experts where ``torch._grouped_mm`` does not run, e.g. on
    CPU or in float32): the rows of ``input`` come sorted by expert, rows ``offs[e-1]`` to
    ``offs[e]`` are multiplied by ``weight[e]``, rows from ``offs[-1]`` on are zeros.

    ``N`` may be split with the output (each expert column-parallel) and ``K`` contracted
    (row-parallel: partial sums; the zero rows sum to zero), as Megatron-LM splits an MLP
    (Shoeybi et al. 2019, §3). The rows and the experts stay whole: ``offs`` counts global
    rows and covers every expert."""
    return DimMap([(None, "k"), (None, "k", "n"), (None,)], [(None, "n")], list(in_shapes), list(out_shapes),
                  reduce=frozenset({"k"}))
