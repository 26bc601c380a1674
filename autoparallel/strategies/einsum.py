"""The record of ``einsum``: dim labels read from the equation.

An einsum is the engine's own description of an op (:mod:`~autoparallel.strategies.engine`):
a letter shared by operands and output is a parallel dim, a letter missing from the output
is summed over, and the op is linear in each operand, so a ``Partial`` operand (the others
replicated) gives a ``Partial`` output. Conventions follow ``torch.einsum``: without
``->`` the output holds the letters that appear once, in alphabetical order, after the
broadcast (``...``) dims; ``...`` dims align from the right and broadcast; ``...`` missing
from an explicit output is summed over.
"""

from __future__ import annotations

import torch

from ..graph import op_args
from .engine import DimMap
from .records import record

aten = torch.ops.aten


def _terms(equation: str, in_shapes) -> tuple[list[list[str]], list[str]]:
    """Per operand, and for the output, one symbol per dim: its letter, or ``"...k"`` for
    the ``k``-th broadcast dim counted from the right."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    ops = []
    for term, shape in zip(lhs.split(","), in_shapes):
        head, dots, tail = term.partition("...")
        n_ell = len(shape) - len(head) - len(tail) if dots else 0
        ops.append(list(head) + [f"...{k}" for k in reversed(range(n_ell))] + list(tail))
    n_ell = max((sum(s.startswith("...") for s in o) for o in ops), default=0)
    ell = [f"...{k}" for k in reversed(range(n_ell))]
    if not arrow:
        letters = [c for o in ops for c in o if not c.startswith("...")]
        return ops, ell + sorted(c for c in set(letters) if letters.count(c) == 1)
    head, dots, tail = rhs.partition("...")
    return ops, list(head) + (ell if dots else []) + list(tail)


@record(aten.einsum.default)
def einsum_rule(node, in_shapes, out_shapes):
    """``einsum(equation, tensors)`` (module docstring). A letter repeated within one
    operand (a diagonal) stays whole; so does a dim of size 1 that broadcasts against a
    larger one."""
    ops, out = _terms(op_args(node)["equation"], in_shapes)
    size: dict[str, int] = {}
    for o, shape in zip(ops, in_shapes):
        for c, n in zip(o, shape):
            size[c] = max(size.get(c, 1), n)
    diagonal = {c for o in ops for c in o if o.count(c) > 1}

    def label(c, n):
        return None if c in diagonal or n != size[c] else c

    ins = [tuple(label(c, n) for c, n in zip(o, shape)) for o, shape in zip(ops, in_shapes)]
    lout = tuple(label(c, size[c]) for c in out)
    reduce = frozenset(c for c in size if c not in out and c not in diagonal)
    return DimMap(ins, [lout], list(in_shapes), list(out_shapes), reduce=reduce,
                  partial=[frozenset([i]) for i in range(len(in_shapes))])
