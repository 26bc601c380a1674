"""How the per-device graph prints: fx's Python code with the emitter's comments.

:func:`~autoparallel.passes.apply_plan` leaves ``node.meta["comment"]`` on the first node of
each redistribution and of each op rewritten for local shards (module path and placements per
mesh axis). :class:`CommentedCode` writes it as a ``#`` line above that node's statement, so
``pmodel.graph_module.code`` stays valid Python that reads like the plan.
"""

from __future__ import annotations

import re

import torch.fx as fx

_COUNTER = re.compile(r"# COUNTER: (\d+)\n")  # fx's marker before each node's statement


class CommentedCode(fx.graph.CodeGen):
    """fx's code generation, with ``node.meta["comment"]`` as a comment line above the node."""

    def _gen_python_code(self, nodes, *args, **kwargs):
        comments = {i: n.meta["comment"] for i, n in enumerate(nodes) if n.meta.get("comment")}

        def insert(body: list[str]) -> list[str]:
            out = []
            for line in body:
                m = _COUNTER.fullmatch(line)
                if m and int(m[1]) in comments:
                    out.append(f"# {comments[int(m[1])]}\n")
                out.append(line)
            return out

        self._body_transformer = insert
        try:
            return super()._gen_python_code(nodes, *args, **kwargs)
        finally:
            self._body_transformer = None


def readable(gm: fx.GraphModule) -> fx.GraphModule:
    """Print ``gm`` and every graph module under it (checkpoint regions) with their comments;
    returns ``gm``, recompiled."""
    for m in gm.modules():
        if isinstance(m, fx.GraphModule):
            m.graph.set_codegen(CommentedCode())
            m.recompile()
    return gm
