"""Records of the recurrent layers ``nn.LSTM`` and ``nn.GRU`` (``aten.lstm.input``,
``aten.gru.input``): the batch may be split; the time and hidden dims stay whole (the
recurrence mixes every hidden unit of one step into the next), and so do the weights."""

from __future__ import annotations

import torch

from ..graph import op_args
from .engine import DimMap
from .records import record

aten = torch.ops.aten


@record(aten.lstm.input, aten.gru.input)
def recurrent_rule(node, in_shapes, out_shapes):
    """Input ``(N, L, H_in)`` with ``batch_first`` else ``(L, N, H_in)``, initial states
    (``h_0``, and ``c_0`` for the LSTM) ``(D·layers, N, H)``, then the flat weight list;
    outputs the sequence (batch where the input has it) and the final states.

    An unbatched input (2-D) has nothing to split: replicated. With dropout between layers
    in training (``dropout > 0``, ``train``, more than one layer) the rule does not cover
    the node: the masks are drawn inside the op, where no pass can make each batch shard
    draw its own."""
    a = op_args(node)
    if a["dropout"] > 0 and a["train"] and a["num_layers"] > 1:
        return None
    x = in_shapes[0]
    n_states = 2 if node.target == aten.lstm.input else 1
    if len(x) != 3:
        return DimMap([(None,) * len(s) for s in in_shapes], [(None,) * len(s) for s in out_shapes],
                      list(in_shapes), list(out_shapes))
    lx = ("b", None, None) if a["batch_first"] else (None, "b", None)
    state = (None, "b", None)
    ins = [lx] + [state] * n_states + [(None,) * len(s) for s in in_shapes[1 + n_states:]]
    return DimMap(ins, [lx] + [state] * n_states, list(in_shapes), list(out_shapes))
