"""Routed experts of a mixture-of-experts layer as one op, and its per-device form with expert
parallelism: tokens sent to the devices that hold their experts with all-to-all, and back.

Capture (:mod:`autoparallel.tracer.experts`) records a Hugging Face experts module (3-D
``gate_up_proj`` ``(E, 2I, H)`` and ``down_proj`` ``(E, H, I)``, called with the hidden states
``(T, H)``, each token's top-``k`` expert ids ``(T, k)`` and routing weights ``(T, k)``) as one
node of :data:`ROUTED_EXPERTS`, so that the planner chooses how the whole block is split
(:mod:`autoparallel.strategies.moe`). The generated code runs :func:`routed_experts` on each
device: the same computation on local tensors, with one *hop* per mesh axis that splits the
experts:

- ``"exchange"`` (tokens and experts split along the axis): each (token, expert) pair is sent
  to the device of the axis that holds its expert, the counts exchanged first, then a
  variable-size ``all_to_all_single``; the results come back by the reverse all-to-all
  (expert parallelism as GShard, Lepikhin et al. 2020, §2.2, dispatches and combines tokens;
  dropless, as MegaBlocks, Gale et al. 2023, §3, computes every routed pair);
- ``"mask"`` (experts split, tokens whole along the axis): each device computes only the pairs
  of its own experts and contributes zeros for the others; the output is a partial sum over
  the axis.

Exact: every pair is computed once, by the same products as the dense op, and the pairs'
results are weighted and summed per token in the same order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.utils.flop_counter import register_flop_formula

from ..placement import R

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
"""The experts' activation by name (as the op's ``act`` argument spells it)."""


def expert_hops(specs, mesh_shape) -> list[tuple[str, int]]:
    """``(kind, axis)`` per mesh axis splitting the experts under ``routed_experts``' input
    ``specs`` (placements of hidden, top_k_index, top_k_weights, gate_up_proj, down_proj), in
    mesh order: ``"exchange"`` where the tokens are split too, else ``"mask"``."""
    return [("exchange" if specs[0][a] != R else "mask", a) for a in range(len(mesh_shape)) if specs[3][a] != R]


def exchanges_over_the_mesh(hops: list[tuple[str, int]], mesh_shape) -> bool:
    """Whether ``hops`` (:func:`expert_hops`) exchange
    tokens along every mesh axis of more than one device, two or more: then one all-to-all over
    the whole mesh sends each pair where the per-axis hops in turn would (the experts and tokens
    nest in mesh order, the first axis the most significant: the mesh's row-major device order),
    with one count exchange and one latency per pass instead of one per axis."""
    split = [a for a, n in enumerate(mesh_shape) if n > 1]
    return len(split) > 1 and [(k, a) for k, a in hops] == [("exchange", a) for a in split]


def _experts_mlp(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, counts: list,
                 act: str) -> torch.Tensor:
    """``x`` ``(S, H)`` with rows sorted by expert, ``counts[e]`` rows for expert ``e``, each
    group through its expert, ``down[e] (act(gate[e] x) * up[e] x)``: ``(S, H)``. One expert
    at a time, as the Hugging Face experts loop computes it, and one ``cat`` at the end (a
    second ``cat``, of every expert's gate and up products, doubled the ``cat`` time of a
    Mixtral step on a CPU: 17.6 against 8.9 ms). Every expert's product runs, empty ones too, so that every
    expert's weight gets a gradient (zeros when no row reached it). The experts' weights are
    taken with ``unbind``, whose backward stacks their gradients into one new tensor; indexing
    ``weight[e]`` would give each expert's gradient a zero-filled tensor of the whole weight's
    size, then sum them."""
    outs = []
    for w1, w2, rows in zip(gate_up_proj.unbind(0), down_proj.unbind(0), torch.split(x, counts)):
        gate, up = (rows.to(w1.dtype) @ w1.t()).chunk(2, dim=-1)
        outs.append((ACTIVATIONS[act](gate) * up).to(w2.dtype) @ w2.t())
    return torch.cat(outs)


def _exchange(x: torch.Tensor, local: torch.Tensor, span: int, n: int, group: str):
    """Send the rows of ``x``, sorted by ``local`` (their expert's index, ``0..span-1``, in the
    experts this device's range holds), to the device of the axis of ``group`` (``n`` devices,
    ``span / n`` experts each) holding their expert; the counts per expert go first, so each
    device knows what it receives and from which expert (no ids travel). Returns the received
    rows (by source device, then by expert), their experts' indices in the receiver's
    ``span / n`` and the split sizes ``(sent, received)`` for the way back."""
    piece = span // n
    counts = torch.bincount(local, minlength=span)
    got = all_to_all_single(counts, [piece] * n, [piece] * n, group).wait()  # source, then own expert
    sent, received = counts.view(n, piece).sum(1).tolist(), got.view(n, piece).sum(1).tolist()
    x = all_to_all_single_autograd(x, received, sent, group)
    mine = torch.arange(piece, device=local.device).repeat(n).repeat_interleave(got)
    return x, mine, sent, received


def routed_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: str,
                   hops: tuple = ()) -> torch.Tensor:
    """The routed experts' output for this device's tokens.

    Args:
        hidden: ``(T, H)`` this device's tokens.
        top_k_index: ``(T, k)`` int64, each token's experts (global ids ``0..E-1``).
        top_k_weights: ``(T, k)`` their routing weights.
        gate_up_proj: ``(E_l, 2I, H)`` this device's experts' gate and up projections (gate
            first), ``down_proj``: ``(E_l, H, I)``; ``E_l = E`` divided by every hop's ``n``.
        act: a key of :data:`ACTIVATIONS`.
        hops: per mesh axis splitting the experts, in mesh order (the first holds the most
            significant piece of the expert dim, as DTensor nests ``Shard(0)``):
            ``(kind, n, coord, group)``: ``"exchange"`` or ``"mask"`` (module docstring), the
            axis's size, this device's coordinate on it (an int or a 1-element tensor) and
            its process-group name.

    Returns:
        ``(T, H)`` in ``hidden``'s dtype: ``Σ_j w[t, j] · down[e](act(gate[e] x_t) · up[e] x_t)``
        with ``e = top_k_index[t, j]`` over this device's share of the pairs (all of them
        without a ``"mask"`` hop; a partial sum over the masking axes otherwise).
    """
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    x = hidden[order // k]
    span = gate_up_proj.shape[0]
    for _, n, _, _ in hops:
        span *= n
    back = []
    for kind, n, coord, group in hops:  # experts: indices into the current range of span experts
        piece = span // n
        if kind == "mask":
            pos = ((experts >= coord * piece) & (experts < (coord + 1) * piece)).nonzero().squeeze(1)
            back.append((kind, pos, x.shape[0]))
            x, experts = x[pos], experts[pos] - coord * piece
        else:
            x, experts, sent, received = _exchange(x, experts, span, n, group)
            resort = torch.argsort(experts, stable=True)
            x, experts = x[resort], experts[resort]
            back.append((kind, resort, (sent, received, group)))
        span = piece
    counts = torch.bincount(experts, minlength=span).tolist()
    y = _experts_mlp(x, gate_up_proj, down_proj, counts, act)
    for kind, where, extra in reversed(back):
        if kind == "mask":
            y = y.new_zeros(extra, y.shape[1]).index_copy(0, where, y)
        else:
            sent, received, group = extra
            y = all_to_all_single_autograd(y[torch.argsort(where)], sent, received, group)
    y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    return y[torch.argsort(order)].view(tokens, k, -1).sum(dim=1).to(hidden.dtype)


@torch.library.custom_op("autoparallel::routed_experts", mutates_args=())
def _routed_experts_op(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: str) -> torch.Tensor:
    return routed_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act)


@_routed_experts_op.register_fake
def _(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act):
    return hidden.new_empty(hidden.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])
    ctx.act = inputs[5]


def _backward(ctx, grad):
    """The gradients of the dense form, by running it again under autograd (the captured op
    runs only where the planner checks it; the generated code calls :func:`routed_experts`)."""
    inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in ctx.saved_tensors]
    with torch.enable_grad():
        out = routed_experts(*inputs, ctx.act)
    wrt = [t for t in inputs if t.requires_grad]
    grads = iter(torch.autograd.grad(out, wrt, grad, allow_unused=True))
    return tuple(next(grads) if t.requires_grad else None for t in inputs) + (None,)


_routed_experts_op.register_autograd(_backward, setup_context=_setup)

ROUTED_EXPERTS = torch.ops.autoparallel.routed_experts.default
"""The captured op: ``routed_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj,
act) -> (T, H)``, :func:`routed_experts` on whole tensors."""


@register_flop_formula(torch.ops.autoparallel.routed_experts)
def routed_experts_flops(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, *args, out_shape=None, **kwargs) -> int:
    """Forward FLOPs from the inputs' shapes (as torch's flop counter passes them): two products per
    routed pair, ``(H → 2I)`` and ``(I → H)``, 2 FLOPs per multiply-add."""
    pairs = top_k_index[0] * top_k_index[1]
    return 2 * pairs * gate_up_proj[1] * gate_up_proj[2] + 2 * pairs * down_proj[1] * down_proj[2]
