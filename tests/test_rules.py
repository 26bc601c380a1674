"""Every strategy of every sharding rule, run on simulated ranks against the dense op.

Each sample below is a tiny module whose tensors are parameters (float) or buffers (int,
bool). It is captured like any model; then every strategy the rule engine lists for every
op node is forced, the per-device module is emitted and run, and its outputs and every
parameter gradient must equal the dense computation. To keep this affordable, round ``i``
forces the ``i``-th strategy of every node at once (the planner converts between them); a
failing round is replayed node by node to name the culprit. Nodes on an edge of an in-place
op (which admits no redistribution) are checked one at a time instead. Every sample runs on a
(4,) mesh, the samples in :data:`TWO_D` also on (2, 2).

:func:`test_every_rule_op_has_a_sample` fails when an op overload with a rule appears in no
sample's captured graph.
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.tensor import Shard

import autoparallel
from autoparallel.codegen.emit import emit
from autoparallel.errors import ShardingRuleError
from autoparallel.mesh import MeshSpec
from autoparallel.placement import R
from autoparallel.solver import CostModel
from autoparallel.solver.planner import Planner
from autoparallel.graph import op_args, tensor_inputs
from autoparallel.strategies import StrategyGenerator, generator
from autoparallel.strategies.coverage import FALLBACK, RULE, coverage_of
from autoparallel.strategies.engine import DimMap
from autoparallel.strategies.records import RECORDS, OpRecord
from autoparallel.strategies.rules import REPLICATE_ONLY, pointwise_dimmap
from autoparallel.tracer import ColoTracer
from models import whole

aten = torch.ops.aten
f32 = torch.float32


def _int(hi, *shape):
    return ("int", hi, shape)


def _bool(*shape):
    return ("bool", shape)


def _pos(x):
    """``x`` mapped into [0.5, ∞), for ops defined on positive numbers."""
    return x.abs() + 0.5


SAMPLES = {
    # matmul family
    "linear_bias": (lambda x, w, b: F.linear(x, w, b), [(8, 16), (12, 16), (12,)]),
    "linear_3d": (lambda x, w: F.linear(x, w), [(4, 6, 16), (8, 16)]),
    "addmm": (lambda b, x, w: (torch.addmm(b, x, w), torch.addmm(b, x, w, beta=0.5, alpha=2.0)),
              [(12,), (8, 16), (16, 12)]),
    "mm": (lambda x, w: torch.mm(x, w), [(8, 16), (16, 12)]),
    "bmm_baddbmm": (lambda a, b, c: (torch.bmm(a, b), torch.baddbmm(c, a, b, alpha=0.5)),
                    [(4, 8, 16), (4, 16, 12), (4, 1, 12)]),
    "matmul_4d": (lambda a, b: torch.matmul(a, b), [(2, 4, 8, 16), (2, 4, 16, 8)]),
    "matmul_broadcast_vectors": (lambda a, w, v: (a @ w, a @ v, v @ w, v @ v, w.t() @ a.transpose(1, 2)),
                                 [(4, 8, 16), (16, 8), (16,)]),
    # NN ops
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, padding=1), [(4, 8, 6, 6), (12, 8, 3, 3), (12,)]),
    "conv2d_depthwise": (lambda x, w, b: F.conv2d(x, w, b, padding=1, groups=8), [(4, 8, 6, 6), (8, 1, 3, 3), (8,)]),
    "conv2d_grouped": (lambda x, w: F.conv2d(x, w, groups=2), [(4, 8, 6, 6), (12, 4, 1, 1)]),
    "conv1d_3d_transposed": (
        lambda x1, w1, x3, w3, w2: (F.conv1d(x1, w1, stride=2), F.conv3d(x3, w3),
                                    aten.convolution.default(x3[:, :, 0], w2, None, [1, 1], [0, 0], [1, 1],
                                                             True, [0, 0], 1)),
        [(4, 8, 10), (12, 8, 3), (4, 4, 3, 4, 4), (8, 4, 1, 2, 2), (4, 2, 2, 2)]),
    "pools": (lambda x: (F.max_pool2d(x, 2), F.avg_pool2d(x, 2), F.adaptive_avg_pool2d(x, 3),
                         F.adaptive_max_pool2d(x, 3), F.max_pool2d(x, 2, return_indices=True)[1],
                         aten._adaptive_avg_pool2d.default(x, [2, 2]), F.max_pool1d(x[:, :, 0], 2),
                         F.avg_pool1d(x[:, :, 0], 2), F.adaptive_avg_pool1d(x[:, :, 0], 3),
                         F.adaptive_max_pool1d(x[:, :, 0], 3), F.max_pool3d(x, 2), F.avg_pool3d(x, 2),
                         F.adaptive_avg_pool3d(x, 2)), [(4, 8, 6, 6)]),
    "embedding": (lambda w, i: F.embedding(i, w), [(32, 16), _int(32, 4, 8)]),
    "layer_norm": (lambda x, w, b: (F.layer_norm(x, (16,), w, b), F.layer_norm(x, (8, 16))), [(4, 8, 16), (16,), (16,)]),
    "rms_norm": (lambda x, w: (F.rms_norm(x, (16,), w), F.rms_norm(x, (8, 16), eps=1e-3)), [(4, 8, 16), (16,)]),
    "sdpa_mask": (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                  [(4, 4, 8, 16), (4, 4, 8, 16), (4, 4, 8, 16), _bool(4, 1, 8, 8)]),
    "sdpa_causal_gqa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                        [(2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)]),
    "sdpa_float_mask_scale": (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3),
                              [(2, 4, 8, 8), (2, 4, 8, 8), (2, 4, 8, 8), (8, 8)]),
    "cross_entropy_mean": (lambda x, t: F.cross_entropy(x, t), [(8, 10), _int(10, 8)]),
    "cross_entropy_ignore": (lambda x, t: (F.cross_entropy(x, t.masked_fill(t > 6, -100)),
                                           F.cross_entropy(x, t, ignore_index=3, reduction="sum")),
                             [(8, 10), _int(10, 8)]),
    "cross_entropy_none": (lambda x, t: F.cross_entropy(x, t, reduction="none"), [(8, 10), _int(10, 8)]),
    # split batch with weight and label smoothing: the local sum over the global denominator
    "cross_entropy_weight_smoothing": (
        lambda x, t, w: (F.cross_entropy(x, t, weight=w.detach().abs() + 0.5, label_smoothing=0.1),
                         F.cross_entropy(x, t.masked_fill(t > 6, -100), weight=w.detach().abs() + 0.5),
                         F.cross_entropy(x, t, label_smoothing=0.2, ignore_index=3),
                         F.cross_entropy(x, t, weight=w.detach(), label_smoothing=0.1, reduction="sum")),
        [(8, 10), _int(10, 8), (10,)]),
    # per-element losses: split whatever weight, ignore_index and label_smoothing are
    "cross_entropy_none_weight_smoothing": (
        lambda x, t, w, xk, tk: (F.cross_entropy(x, t, weight=w.detach(), reduction="none"),
                                 F.cross_entropy(x, t, label_smoothing=0.1, ignore_index=2, reduction="none"),
                                 F.cross_entropy(xk, tk, weight=w.detach(), label_smoothing=0.2, reduction="none"),
                                 F.cross_entropy(xk, tk), F.cross_entropy(x[0], t[0])),
        [(8, 10), _int(10, 8), (10,), (4, 10, 4), _int(10, 4, 4)]),
    # log_softmax + nll_loss, classes split too (more in tests/test_vocab_parallel.py)
    "nll_loss": (lambda x, t, w: (F.nll_loss(F.log_softmax(x, 1), t.masked_fill(t > 6, -100), weight=w.detach()),
                                  aten.nll_loss.default(x.log_softmax(-1), t, None, 2, 3),
                                  F.nll_loss(x.log_softmax(1), t, reduction="none")),
                 [(8, 8), _int(8, 8), (8,)]),
    # captured as broadcast_tensors + mse_loss, decomposed into expand, sub, mul, mean/sum
    "mse_loss": (lambda x, y, z: (F.mse_loss(x, y), F.mse_loss(x, z, reduction="sum"), F.mse_loss(x, y, reduction="none")),
                 [(8, 6), (8, 6), (1, 6)]),
    "gather_index_select": (lambda x, i, y, j: (torch.gather(x, 1, i), torch.gather(x, -1, i[:, :1]),
                                                 y.index_select(1, j), y.index_select(-1, j[:2]), x[i]),
                            [(4, 8), _int(4, 4, 3), (4, 8, 6), _int(6, 3)]),
    # channels split by whole groups only (2 groups: not 4 ways), with and without affine
    "group_norm": (lambda x, w, b: (F.group_norm(x, 4, w, b), F.group_norm(x, 2), F.group_norm(x[:, :, 0], 1, w)),
                   [(4, 8, 3), (8,), (8,)]),
    "einsum": (lambda a, b, c: (torch.einsum("bij,bjk->bik", a, b), torch.einsum("bij->j", a),
                                torch.einsum("...ij,...jk", a, b), torch.einsum("ii->i", c),
                                torch.einsum("bij,bjk->bik", a, b[:1]), torch.einsum("ij,ij->", c, c * 2),
                                torch.einsum("...ij->ij", a), torch.einsum("b i j , j -> b i", a, c[0])),
               [(4, 8, 4), (4, 4, 8), (4, 4)]),
    # mean over a split input divides the local sum by the global count; broadcast weights stay whole
    "bce_with_logits": (lambda x, t, w, pw: (
        F.binary_cross_entropy_with_logits(x, t.detach().sigmoid()),
        F.binary_cross_entropy_with_logits(x, t.detach().sigmoid(), weight=w.detach(), pos_weight=_pos(pw).detach(),
                                           reduction="sum"),
        F.binary_cross_entropy_with_logits(x, t.detach().sigmoid(), weight=_pos(t).detach()),
        F.binary_cross_entropy_with_logits(x, t.detach().sigmoid(), weight=w[None].detach(),
                                           pos_weight=_pos(pw).detach(), reduction="none")),
        [(4, 8), (4, 8), (8,), (8,)]),
    # bags of one length (a 2-D input): split by bags
    "embedding_bag": (lambda w, i, p: (F.embedding_bag(i, w, mode="mean"), F.embedding_bag(i, w, mode="max"),
                                       F.embedding_bag(i, w, mode="sum", per_sample_weights=p, padding_idx=0),
                                       aten.embedding_bag.default(w, i.flatten(), torch.arange(0, 12, 3))[0]),
                      [(32, 16), _int(32, 4, 3), (4, 3)]),
    # lstm: batch first, a learnt initial state; gru: time first, bidirectional, two layers, no biases
    "lstm_gru": (lambda x, h, w1, w2, b1, b2, g1, g2, g3, g4: (
        *aten.lstm.input(x, [h, torch.zeros(1, 4, 6)], [w1, w2, b1, b2], True, 1, 0.0, True, False, True),
        *aten.gru.input(x.transpose(0, 1), torch.zeros(4, 4, 6), [g1, g2, g1, g2, g3, g4, g3, g4], False, 2, 0.5,
                       False, True, False)),
        [(4, 5, 8), (1, 4, 6), (24, 8), (24, 6), (24,), (24,), (18, 8), (18, 6), (18, 12), (18, 6)]),
    "weight_norm": (lambda v, g, g2, g3: (aten._weight_norm.default(v, g), aten._weight_norm.default(v, g2, 2),
                                          aten._weight_norm.default(v, g3, -1)), [(8, 4, 4), (8, 1, 1), (1, 1, 4), (1, 1, 1)]),
    # in place on activations: the written tensor keeps its split
    "in_place": (lambda x, m, j, v, v2: (
        F.hardswish(x * 1, inplace=True), (x * 1).fill_(v[0, 0]), aten.index_put_.default(x * 1, [m], v),
        aten.index_put_.default(x * 1, [j], v2, True), aten.index_put_.default(x * 1, [None, j[:2]], v[0, 0]),
        x[:, :, 0].T), [(4, 8, 4), _bool(4), _int(4, 3), (8, 4), (3, 8, 4)]),
    # pointwise, with broadcasting either way and Partial-linear ops
    "pointwise_unary": (lambda x: (
        -x, x.exp(), _pos(x).log(), x.tanh(), x.sigmoid(), F.silu(x), F.gelu(x), F.relu(x), torch.erf(x), x.cos(),
        x.sin(), _pos(x).reciprocal(), x.sign(), x.floor(), x.ceil(), x.round(), _pos(x).log1p(), x.expm1(),
        F.softplus(x), F.leaky_relu(x), F.hardtanh(x), F.elu(x), F.mish(x), F.hardswish(x), F.hardsigmoid(x),
        F.relu6(x), F.dropout(x, 0.0, True), _pos(x).rsqrt(), _pos(x).sqrt(), x ** 2, 2 ** x, x.square(),
        x.nan_to_num(), x.isnan(), x.isinf(), 1 - x, x / 3, aten.add.Scalar(x, 1), aten.sub.Scalar(x, 1),
        aten.mul.Scalar(x, 2), aten.div.Scalar(x, 2)), [(4, 4)]),
    "casts_copies_creation_like": (lambda x: (
        x.to(torch.bfloat16).float(), aten.to.dtype_layout(x, dtype=torch.float64),
        aten.to.device(x, torch.device("cpu"), torch.float64), aten._to_copy.default(x, dtype=torch.float64),
        x.clone(), aten.contiguous.default(x.t()), aten.alias.default(x) * 1, x.detach(), torch.tensor(3.0) * x,
        torch.zeros_like(x), torch.ones_like(x), torch.full_like(x, 2.0), aten.fill.Scalar(torch.empty_like(x), 2.0)),
        [(4, 4)]),
    # masked_fill's 0-d value is z[0, 0], not torch.tensor(2.0): passes/apply_plan.py's R → P "mask"
    # move gives a 0-d tensor shape (1,), which masked_fill refuses (a codegen bug to fix there)
    "pointwise_binary_broadcast": (lambda x, y, z: (
        x + y, z - x, z * y, x / _pos(z), torch.rsub(x, y), _pos(x) ** z, torch.add(x, z, alpha=2),
        torch.where(x > z, x, y), torch.where(x > 0, x, 0.5), torch.where(y > 0, 0.5, z),
        x.masked_fill(z > 0, 0.5), x.masked_fill(y < 0, z[0, 0]), x.clamp(-0.5, 0.5),
        x.clamp(z - 1, y + 1), x.clamp_min(0.1), x.clamp_max(0.1), torch.minimum(x, y), torch.maximum(z, x),
        torch.floor_divide(x.detach(), _pos(y).detach()), x % 0.7, torch.remainder(x, _pos(z)), torch.lerp(x, y, 0.3),
        torch.addcmul(x, y, z), torch.addcdiv(z, x, _pos(y))), [(4, 4), (4,), (4, 1)]),
    "broadcast_either_side": (lambda x, y, z: (x + y, z - x, z * y, torch.where(x > z, x, y)),
                              [(4, 4), (4,), (4, 1)]),
    "compare_logic_broadcast": (lambda x, y, z: (
        x == y, x == 0.5, x != z, x != 0.5, x < y, x < 0.5, x <= z, x <= 0.5, x >= z, x >= 0.5,
        (x > 0) & (y > 0), (x > 0) | (z > 0), torch.bitwise_and(x > 0, z > 0), torch.bitwise_or(y > 0, z > 0),
        torch.bitwise_xor(x > 0, y > 0), ~(x > 0), torch.logical_and(x, y), torch.logical_or(z, x),
        torch.logical_not(x)), [(4, 4), (4,), (4, 1)]),
    # type_as: `other` supplies only dtype and device, whatever its shape (DeBERTa-v2:
    # torch.tensor(mid - 1).type_as(relative_pos)); capture rewrites it into to(dtype=, device=)
    "type_as": (lambda x, i: (torch.tensor(3).type_as(i) * x, x.type_as(i[0]), x[0].double().type_as(x) * x),
                [(4, 4), _int(5, 4, 4, 4)]),
    # shapes
    "view_reshape_squeeze": (lambda x: (
        x.view(4, 32).view(4, 2, 4, 4) * 2, x.reshape(32, 4), aten._unsafe_view.default(x, [4, 32]),
        x.unsqueeze(1).squeeze(1), x.unsqueeze(0).squeeze(), x[None, :, None].squeeze((0, 2)), x.flatten(1),
        x.flatten(0, 1).unflatten(0, (4, 8)), x.unflatten(1, (2, 4))), [(4, 8, 4)]),
    "view_merge_split": (lambda x: (x.view(4, 32).view(4, 2, 4, 4), x.unflatten(1, (2, 4)), x.flatten(0, 1)),
                         [(4, 8, 4)]),
    # view_as, reshape_as, expand_as: the second argument supplies only a shape
    "view_as_reshape_as_expand_as": (lambda x, y, z: (x.view_as(y), x.reshape_as(y), z.expand_as(x),
                                                      x.view(4, 4, 4).reshape_as(x)),
                                     [(4, 16), (4, 4, 4), (4, 1)]),
    "expand": (lambda x: (x.expand(4, 6, 8), x.expand(2, -1, 3, -1)), [(4, 1, 8)]),
    "permute": (lambda x: (x.transpose(0, -1), x[0].t(), x.permute(2, 0, 1), x.permute(-1, -3, -2),
                           x.movedim(0, -1), x.movedim(-1, 0)), [(4, 8, 2)]),
    "slice_select": (lambda x: (x[:, 2:6] + x[:, :4] * x[:, :, :1].squeeze(-1).unsqueeze(1)[:, :, :1], x[:, ::2],
                                x[:, -8:], x[..., 1:100], x.select(1, 3) * 2, x.select(-1, -1)), [(4, 8, 8)]),
    "split_cat": (lambda x, y: (torch.cat(list(torch.split(x, 8, -1))[::-1] + [y], 1),
                                torch.cat(x.split([4, 12], 2), -1), torch.cat(list(x.unbind(1)), 0)),
                  [(4, 8, 16), (4, 8, 8)]),
    "chunk_stack": (lambda x: (torch.stack(torch.chunk(x, 2, 1), 0).sum(0), torch.stack(x.chunk(4, -1), -1)),
                    [(4, 8, 16)]),
    "pad": (lambda x: (F.pad(x, (1, 2)), F.pad(x, (1, 1, 2, 0), mode="reflect"), aten.constant_pad_nd.default(x, [1, 1], 0.5)),
            [(4, 8, 16)]),
    "repeat_interleave": (lambda x: (torch.repeat_interleave(x, 2, 1), x.repeat_interleave(2, -1, output_size=8),
                                     x.repeat_interleave(2), x.repeat_interleave(3, output_size=384), x[:1].repeat_interleave(2)),
                          [(4, 8, 4)]),
    # scans, sorts and ops along dims; roll with shifts and dims, several dims, no dims
    "along_dims": (lambda x: (
        x.cumsum(1), x.cumprod(-1), x.softmax(0), x.log_softmax(-1), aten._softmax.default(x, 1, False),
        aten._log_softmax.default(x, 0, False), x.flip(0, 1), x.flip(-1), torch.roll(x, 1, 0),
        torch.roll(x, (1, -2), (0, 1)), torch.roll(x, 3), torch.roll(x, -1, -1), x.sort(1).values, x.sort(0).indices,
        x.sort(0, descending=True).values, x.argsort(-1, descending=True)), [(4, 8)]),
    # mixture-of-experts routing. topk: largest and smallest, unsorted; sort and argsort stable
    # and descending, on ints with many ties (stability decides their indices)
    "topk_sort_stable": (lambda x, i: (
        x.topk(3).values, x.topk(2, dim=0, largest=False).indices, x.topk(3, 1, sorted=False).values,
        torch.topk(x, 1, 0, True, True)[1], x.sort(stable=True).values,
        x.sort(dim=0, descending=True, stable=True).indices, i.sort(stable=True).indices,
        i.sort(dim=0, descending=True, stable=True).indices, i.argsort(stable=True, dim=-1),
        i.argsort(dim=0, descending=True, stable=True)), [(4, 8), _int(3, 4, 8)]),
    # histc: a range given (positionally, by name, only max; values outside it dropped) splits the
    # input into a Partial count; min == max (0, 0 or the default: the data's range) keeps it whole;
    # the router's count of sorted expert ids as float (Hugging Face's grouped experts)
    "histc": (lambda x, y, i: (
        torch.histc(x.detach(), 5, -1.0, 1.0), torch.histc(x.detach(), 4, 0, 0), torch.histc(y.detach()),
        aten.histc.default(y.detach(), max=2.0), torch.histc(y.detach().abs(), bins=3, min=0.5, max=2),
        torch.histc(i.flatten().sort().values.float(), 4, 0, 3)), [(4, 8), (4, 4, 4), _int(4, 8, 2)]),
    # scatter_add: terms split along dim with self Partial; src larger than index (dim 0 of u, the
    # scatter dim of t: detached, as torch's backward has no gradient for such a src) or index
    # smaller than self keep those dims whole; in place on an activation
    "scatter_add": (lambda x, i, s, u, j, t: (
        x.scatter_add(1, i, s), x.scatter_add(1, i, u.detach()), x.scatter_add(-2, j, t.detach()),
        x.scatter_add(0, j, t[:2]),
        (x * 1).scatter_add_(1, i, s)), [(4, 8), _int(8, 4, 3), (4, 3), (6, 3), _int(4, 2, 8), (4, 8)]),
    # scatter of a value (a router's group mask) and of src, in place; index smaller than self
    # along a dim keeps that dim whole
    "scatter": (lambda x, i, s: (
        x.scatter(1, i, 1.0), x.scatter(-1, i, s), (x * 1).scatter_(1, i, -0.5), x.scatter(1, i[:2], 2.0),
        (x * 1).scatter_(1, i, s)), [(4, 8), _int(8, 4, 3), (4, 3)]),
    # index_add with alpha, along either dim, in place; repeated indices add up
    "index_add": (lambda x, i, s, k, y: (
        x.index_add(0, i, s), x.index_add(-1, k, y, alpha=-0.5), (x * 1).index_add_(0, i, s, alpha=2.0)),
        [(8, 6), _int(8, 4), (4, 6), _int(6, 2), (8, 2)]),
    "diff": (lambda x, p, q: (torch.diff(x, dim=1), torch.diff(x, n=2, dim=0, prepend=p, append=q), torch.diff(x)),
             [(4, 8), (2, 8), (1, 8)]),
    # reductions: dims as int, list, negative, none or empty; keepdim; norm with p
    "sum_mean": (lambda x: (x.sum(-1), x.sum(1).sum(1, keepdim=True), x.sum(), x.sum((0, 2)),
                            aten.sum.dim_IntList(x, []), x.mean(1), x.mean(), x.mean((-1, 0), keepdim=True)),
                 [(4, 8, 16)]),
    "reductions": (lambda x: (
        x.amax(-1), x.amax((0, 1)), x.amin(1, keepdim=True), x.max(1).values, x.max(0).indices, x.min(1).values,
        x.argmax(), x.argmax(1, keepdim=True), x.argmin(0), aten.var.correction(x, [1], correction=0),
        aten.var.correction(x), aten.std.correction(x, [0], keepdim=True), aten.var.dim(x, [0]),
        aten.std.dim(x, [1], True, True), (x > 0).any(1), (x > 0).all(0), x.prod(1), x.prod(0, keepdim=True),
        aten.norm.ScalarOpt_dim(x, 2, [1]), aten.norm.ScalarOpt_dim(x, 3, [0], True), x.logsumexp(1),
        aten.var_mean.correction(x, [1], correction=1)[0]), [(4, 8)]),
    # .item() returns a Python number: it reads its input replicated (every device the global value)
    "item_scalar": (lambda x, w: x * w.sum().item(), [(4, 8), (4, 8)]),
    # creation ops
    "arange_full": (lambda x: x + torch.arange(16, dtype=f32) + torch.full((16,), 2.0) + torch.zeros(8, 16),  # no device=
                    [(4, 8, 16)]),
    "new_ones": (lambda x: x * x.new_ones((4, 8)).tril(), [(4, 8)]),
    # new_* captured as the creation op (empty filled in place, as DeepSeek's query is built)
    "new_filled": (lambda x: (x.new_empty((4, 8)).fill_(3.0) * x + x.new_zeros(4, 8) + x.new_full((4, 8), 2.0),
                              torch.empty(4, 8).copy_(x) * 2), [(4, 8)]),
}

TWO_D = {"group_norm", "einsum", "linear_bias", "addmm", "bmm_baddbmm", "conv2d_depthwise", "embedding", "layer_norm", "sdpa_mask",
         "sdpa_causal_gqa", "cross_entropy_ignore", "gather_index_select", "broadcast_either_side", "type_as",
         "view_merge_split", "view_as_reshape_as_expand_as", "expand", "along_dims", "sum_mean", "reductions",
         "topk_sort_stable", "histc", "scatter_add", "scatter", "index_add"}
"""Samples also checked on a (2, 2) mesh (labels split over two axes, Partial on one axis
and Shard on the other); the rest use rules whose DimMap the (4,) mesh already exercises."""


class OpModule(torch.nn.Module):
    def __init__(self, fn, specs, seed):
        super().__init__()
        self.fn = fn
        g = torch.Generator().manual_seed(seed)
        self.names = []
        for i, s in enumerate(specs):
            name = f"t{i}"
            if isinstance(s[0], str) and s[0] == "int":
                self.register_buffer(name, torch.randint(0, s[1], s[2], generator=g))
            elif isinstance(s[0], str) and s[0] == "bool":
                self.register_buffer(name, torch.rand(s[1], generator=g) > 0.5)
            else:
                self.register_parameter(name, torch.nn.Parameter(torch.randn(s, generator=g)))
            self.names.append(name)

    def forward(self):
        return self.fn(*[getattr(self, n) for n in self.names])


def _leaves(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _ranks(t):
    return list(t._local_tensors.values()) if isinstance(t, LocalTensor) else [t]


@functools.lru_cache(maxsize=None)
def _captured(fn, specs):
    """``(model, traced)`` of a sample, captured once per test session."""
    model = OpModule(fn, specs, seed=0)
    return model, ColoTracer().trace(model, ())


def _match_in_place(choice, node, strategies, planner) -> bool:
    """Edges an in-place op writes through admit no redistribution (the planner pins them):
    give the other end of each such edge at ``node`` a strategy that matches ``node``'s."""
    for c, j in planner.pricing.pinned:
        x = tensor_inputs(c)[j][1]
        if c is node and x in strategies:
            match = next((t for t in strategies[x] if t.outputs[0] == choice[c].inputs[j]), None)
            other = x
        elif x is node:
            match = next((t for t in strategies[c] if t.inputs[j] == choice[x].outputs[0]), None)
            other = c
        else:
            continue
        if match is None:
            return False
        choice[other] = match
    return True


def _check_all_strategies(name, mesh_shape, sim_mesh, seen_targets, samples=SAMPLES):
    """Force every strategy of every op node of ``samples[name]`` (module docstring);
    adds the op overloads of the sample's nodes to ``seen_targets``; returns the generator."""
    fn, specs = samples[name]
    mesh = sim_mesh(mesh_shape)
    model, traced = _captured(fn, tuple(specs))
    model.zero_grad()
    ref_out = _leaves(model())
    weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(1)) for o in ref_out]
    loss = sum((o * w).sum() for o, w in zip(ref_out, weights) if o.dtype.is_floating_point)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    gen = StrategyGenerator(mesh_shape)
    strategies = gen.generate(traced.gm)
    assert not gen.fallbacks, f"{name}: ops without a rule: {dict(gen.fallbacks)}"
    planner = Planner(traced.gm, strategies, gen.aliases, MeshSpec(mesh_shape), CostModel(),
                      dict(traced.params, **traced.buffers))
    repl = (R,) * len(mesh_shape)
    base = {node: next(s for s in ss if all(x == repl for x in s.outputs + s.inputs))
            for node, ss in strategies.items()}
    ops = [n for n in strategies if n.op == "call_function"]
    seen_targets.update(n.target for n in ops)

    def failure(choice) -> str | None:
        """Why the module emitted for ``choice`` differs from the dense one (None: it does not)."""
        plan = planner.make_plan(choice)
        forced = ", ".join(f"{n.name} ({n.target}) under {plan.nodes[n.name].specs_str()}"
                           for n in ops if choice[n] is not base[n])
        what = f"{name} on {mesh_shape}: {forced}"
        try:
            with LocalTensorMode(frozenset(range(mesh.size()))):
                pmodel = emit(copy.deepcopy(model), traced, plan, mesh)
                outs = _leaves(pmodel())
                for o, r in zip(outs, ref_out):
                    for v in _ranks(o.detach()):
                        torch.testing.assert_close(v, r.detach(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")
                loss = sum((o * w).sum() for o, w in zip(outs, weights) if o.dtype.is_floating_point)
                if ref_grads and isinstance(loss, torch.Tensor) and loss.requires_grad:
                    loss.backward()
                    for pname, p in pmodel.named_parameters():
                        if ref_grads.get(pname) is None:
                            continue
                        for v in _ranks(whole(p.grad)):
                            torch.testing.assert_close(v, ref_grads[pname], rtol=1e-4, atol=1e-5,
                                                       msg=lambda m: f"{what}, grad of {pname}: {m}")
        except AssertionError as e:
            return str(e)
        except Exception as e:  # the emitted module does not run
            return f"{what}: {type(e).__name__}: {e}"
        return None

    pinned = {n for c, j in planner.pricing.pinned for n in (c, tensor_inputs(c)[j][1])}
    together = [n for n in ops if n not in pinned]
    checked = 0
    for i in range(max((len(strategies[n]) for n in together), default=0)):
        choice = dict(base)
        choice.update({n: strategies[n][i % len(strategies[n])] for n in together})
        err = failure(choice)
        if err is not None:
            for n in together:  # name the culprit
                alone = dict(base)
                alone[n] = choice[n]
                err_alone = failure(alone)
                assert err_alone is None, err_alone
            raise AssertionError(f"only with all nodes forced at once: {err}")
        checked += 1
    for n in sorted(pinned & set(ops), key=ops.index):
        for s in strategies[n]:
            choice = dict(base)
            choice[n] = s
            if not _match_in_place(choice, n, strategies, planner):
                continue  # no plan can use it: an in-place op would write into a converted copy
            err = failure(choice)
            assert err is None, err
            checked += 1
    assert checked > 0
    return gen


@pytest.mark.parametrize("name,mesh_shape",
                         [(n, (4,)) for n in sorted(SAMPLES)] + [(n, (2, 2)) for n in sorted(TWO_D)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_every_strategy_matches_the_dense_op(name, mesh_shape, sim_mesh):
    _check_all_strategies(name, mesh_shape, sim_mesh, set())


def test_every_rule_op_has_a_sample():
    """Every ATen op overload with a rule, and some replicated-by-rule op, is in a sample's graph
    (ops of other namespaces, a library's recorded by name and our routed experts, have their
    samples in tests/test_moe_rules.py)."""
    assert TWO_D <= set(SAMPLES)
    seen = set()
    for fn, specs in SAMPLES.values():
        _, traced = _captured(fn, tuple(specs))
        seen.update(n.target for n in traced.gm.graph.nodes if n.op == "call_function")
    missing = sorted(str(op) for op in RECORDS if not isinstance(op, str) and op.namespace == "aten" and op not in seen)
    assert not missing, f"ops with a rule but no sample in tests/test_rules.py: {missing}"
    assert REPLICATE_ONLY & seen


class _HuberLosses(torch.nn.Module):
    """Two huber losses: one with the default delta, one with another."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 10)

    def forward(self, x, y):
        z = self.proj(x)
        return F.huber_loss(z, y) + F.huber_loss(z, y, delta=2.0)


def _huber_rule(node, in_shapes, out_shapes):
    """A rule (for this test only) that covers delta 1 (everything replicated) and gives
    nothing for any other delta."""
    if op_args(node)["delta"] != 1.0:
        return None
    return DimMap([(None,) * len(s) for s in in_shapes], [(None,) * len(s) for s in out_shapes],
                  list(in_shapes), list(out_shapes))


def test_a_node_no_rule_covers_is_a_fallback_everywhere(monkeypatch):
    """A rule that gives nothing for a node (and DTensor's registry has no entry): the
    generator records it (plan.inspection.fallback_ops), coverage() reports it as a
    replicate fallback beside the op's covered node, and strict=True raises for it."""
    op = "aten.huber_loss.default"
    monkeypatch.setitem(RECORDS, aten.huber_loss.default, OpRecord(_huber_rule))
    model = _HuberLosses()
    inputs = (torch.empty(8, 16, device="meta"), torch.empty(8, 10, device="meta"))
    traced = ColoTracer().trace(model, inputs)
    gen = StrategyGenerator((4,))
    gen.generate(traced.gm)
    assert set(gen.fallbacks) == {op}
    rows = {(r.op, r.source): r.nodes for r in coverage_of(traced.gm).rows}
    assert rows[(op, FALLBACK)] == 1 and rows[(op, RULE)] == 1
    with pytest.raises(ShardingRuleError, match=r"aten\.huber_loss\.default \(used in: <root>\)"):
        StrategyGenerator((4,), strict=True).generate(traced.gm)
    plan = autoparallel.plan(model, inputs, mesh_shape=(4,), cache_dir=False)
    assert plan.inspection.fallback_ops == [op]


def test_pointwise_rule_declines_an_input_that_does_not_broadcast_into_the_output():
    """Labels are aligned from the right; an input with more dims than the output would wrap
    around to wrong labels, one with a mismatched dim would be split unlike the output."""
    assert pointwise_dimmap(None, [(4, 4, 4)], [(4, 4)]) is None
    assert pointwise_dimmap(None, [(4, 3)], [(4, 4)]) is None
    dm = pointwise_dimmap(None, [(4, 4), (1, 4)], [(4, 4)])
    assert dm.inputs == [("d0", "d1"), (None, "d1")]


def test_an_op_tagged_pointwise_gets_the_pointwise_rule_when_the_registry_does_not_split_it(monkeypatch):
    """``torch.Tag.pointwise`` classifies ops without a record of ours: ``atan2`` (tagged, no
    record), with DTensor's registry made silent, is split like any broadcasting pointwise op."""
    monkeypatch.setattr(generator, "registry_strategies", lambda node, mesh_shape: None)
    _, traced = _captured(torch.atan2, ((4, 8), (8,)))
    node = next(n for n in traced.gm.graph.nodes if n.target == aten.atan2.default)
    strategies, source = generator.node_strategies(node, (4,))
    assert aten.atan2.default not in RECORDS and source == RULE
    assert {s.inputs for s in strategies} == {((R,), (R,)), ((Shard(0),), (R,)), ((Shard(1),), (Shard(0),))}
