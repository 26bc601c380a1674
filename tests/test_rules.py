"""Every strategy of every sharding rule, run on simulated ranks against the dense op.

Each sample below is a tiny module whose tensors are parameters (float) or buffers (int,
bool). It is captured like any model; then, for every op node and every strategy the rule
engine lists for it on a 1-D and a 2-D mesh, that one strategy is forced (everything else
replicated), the per-device module is emitted and run, and its output and every parameter
gradient must equal the dense computation. The registry check at the end fails when a rule
is added without a sample that exercises it.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

from autoparallel.api import emit
from autoparallel.mesh import MeshSpec
from autoparallel.placement import R
from autoparallel.solver import CostModel
from autoparallel.solver.planner import Planner
from autoparallel.strategies import StrategyGenerator, tensor_inputs
from autoparallel.strategies.rules import REPLICATE_ONLY, RULES
from autoparallel.tracer import ColoTracer

aten = torch.ops.aten
f32 = torch.float32


def _int(hi, *shape):
    return ("int", hi, shape)


def _bool(*shape):
    return ("bool", shape)


SAMPLES = {
    # matmul family
    "linear_bias": (lambda x, w, b: F.linear(x, w, b), [(8, 16), (12, 16), (12,)]),
    "linear_3d": (lambda x, w: F.linear(x, w), [(4, 6, 16), (8, 16)]),
    "addmm": (lambda b, x, w: torch.addmm(b, x, w), [(12,), (8, 16), (16, 12)]),
    "mm": (lambda x, w: x @ w, [(8, 16), (16, 12)]),
    "bmm": (lambda a, b: torch.bmm(a, b), [(4, 8, 16), (4, 16, 12)]),
    "matmul_4d": (lambda a, b: torch.matmul(a, b), [(2, 4, 8, 16), (2, 4, 16, 8)]),
    # NN ops
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, padding=1), [(4, 8, 6, 6), (12, 8, 3, 3), (12,)]),
    "conv2d_depthwise": (lambda x, w, b: F.conv2d(x, w, b, padding=1, groups=8), [(4, 8, 6, 6), (8, 1, 3, 3), (8,)]),
    "conv2d_grouped": (lambda x, w: F.conv2d(x, w, groups=2), [(4, 8, 6, 6), (12, 4, 1, 1)]),
    "conv1d": (lambda x, w: F.conv1d(x, w, stride=2), [(4, 8, 10), (12, 8, 3)]),
    "pools": (lambda x: F.max_pool2d(x, 2) + F.avg_pool2d(x, 2) + F.adaptive_avg_pool2d(x, 3), [(4, 8, 6, 6)]),
    "embedding": (lambda w, i: F.embedding(i, w), [(32, 16), _int(32, 4, 8)]),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (16,), w, b), [(4, 8, 16), (16,), (16,)]),
    "rms_norm": (lambda x, w: F.rms_norm(x, (16,), w), [(4, 8, 16), (16,)]),
    "sdpa_mask": (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                  [(4, 4, 8, 16), (4, 4, 8, 16), (4, 4, 8, 16), _bool(4, 1, 8, 8)]),
    "sdpa_causal_gqa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                        [(2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)]),
    "softmax": (lambda x: torch.softmax(x, -1), [(4, 8, 16)]),
    "log_softmax": (lambda x: torch.log_softmax(x, 1), [(4, 8, 16)]),
    "cross_entropy_mean": (lambda x, t: F.cross_entropy(x, t), [(8, 10), _int(10, 8)]),
    "cross_entropy_ignore": (lambda x, t: F.cross_entropy(x, t.masked_fill(t > 6, -100)), [(8, 10), _int(10, 8)]),
    "cross_entropy_sum": (lambda x, t: F.cross_entropy(x, t, reduction="sum"), [(8, 10), _int(10, 8)]),
    "cross_entropy_none": (lambda x, t: F.cross_entropy(x, t, reduction="none"), [(8, 10), _int(10, 8)]),
    # captured as broadcast_tensors + mse_loss, decomposed into expand, sub, mul, mean/sum
    "mse_loss_mean": (lambda x, y: F.mse_loss(x, y), [(8, 6), (8, 6)]),
    "mse_loss_sum_broadcast": (lambda x, y: F.mse_loss(x, y, reduction="sum"), [(8, 6), (1, 6)]),
    "mse_loss_none": (lambda x, y: F.mse_loss(x, y, reduction="none"), [(8, 6), (8, 6)]),
    "gather": (lambda x, i: torch.gather(x, 1, i), [(4, 8), _int(8, 4, 3)]),
    "index_select": (lambda x, i: x.index_select(1, i), [(4, 8, 6), _int(8, 3)]),
    "index": (lambda x, i: x[i], [(8, 4), _int(8, 4)]),
    # pointwise, with broadcasting and Partial-linear ops
    "unary": (lambda x: F.gelu(x) + F.silu(x) * torch.tanh(x) - torch.relu(-x) + torch.sigmoid(x).exp()
              + torch.rsqrt(x.abs() + 1) + x.pow(2) + x.sin() * x.cos(), [(4, 8, 16)]),
    "binary_broadcast": (lambda x, y, z: (x + y) * z - x / (y.abs() + 1) + torch.where(x > 0, x, z),
                         [(4, 8, 16), (16,), (8, 1)]),
    "masked_fill": (lambda x, m: x.masked_fill(m, 0.0), [(4, 8), _bool(4, 8)]),
    "casts": (lambda x: x.to(torch.bfloat16).float() + x.clone().contiguous(), [(4, 8)]),
    "dropout_p0": (lambda x: F.dropout(x, 0.0, True), [(4, 8)]),
    "compare_logic": (lambda x, y: ((x > y) & (x <= 0.5) | (x == y)).float() * x, [(4, 8), (4, 8)]),
    # shapes
    "view_merge_split": (lambda x: x.view(4, 128).view(4, 8, 4, 4) * 2, [(4, 8, 16)]),
    "reshape_transpose": (lambda x: x.transpose(1, 2).reshape(4, 4, 32).permute(2, 0, 1).contiguous(),
                          [(4, 8, 16)]),
    "unsqueeze_expand": (lambda x: x.unsqueeze(0).expand(4, 8, 16).squeeze(0) * 1.5, [(8, 16)]),
    "slice_select": (lambda x: x[:, 2:6] + x[:, :4] * x[:, :, :1].squeeze(-1).unsqueeze(1)[:, :, :1], [(4, 8, 8)]),
    "select": (lambda x: x.select(1, 3) * 2, [(4, 8, 16)]),
    "split_cat": (lambda x, y: torch.cat(list(torch.split(x, 8, -1))[::-1] + [y], 1), [(4, 8, 16), (4, 8, 8)]),
    "chunk_stack": (lambda x: torch.stack(torch.chunk(x, 2, 1), 0).sum(0), [(4, 8, 16)]),
    "pad": (lambda x: F.pad(x, (1, 2)), [(4, 8, 16)]),
    "repeat_interleave": (lambda x: (torch.repeat_interleave(x, 2, 1), x.repeat_interleave(2, -1, output_size=8),
                                     x.repeat_interleave(2)), [(4, 8, 4)]),
    # reductions and scans
    "sum": (lambda x: x.sum(-1) + x.sum(1).sum(1, keepdim=True) + x.sum(), [(4, 8, 16)]),
    "mean": (lambda x: x.mean(1) + x.mean(), [(4, 8, 16)]),
    "amax_var": (lambda x: x.amax(-1) + x.var(-1), [(4, 8, 16)]),
    "cumsum_diff": (lambda x: torch.cumsum(x, 1) + F.pad(torch.diff(x, dim=1), (0, 0, 1, 0)), [(4, 8, 16)]),
    # creation ops
    "arange_full": (lambda x: x + torch.arange(16, dtype=f32) + torch.full((16,), 2.0) + torch.zeros(8, 16),  # no device=
                    [(4, 8, 16)]),
    "new_ones": (lambda x: x * x.new_ones((4, 8)).tril(), [(4, 8)]),
}


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


def _match_in_place(choice, node, strategies, planner) -> bool:
    """Edges an in-place op writes through admit no conversion (the planner pins them):
    give the other end of each such edge at ``node`` a strategy that matches ``node``'s."""
    for c, j in planner._pinned:
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
    """Force every strategy of every op node of ``samples[name]`` in turn; returns the generator."""
    fn, specs = samples[name]
    mesh = sim_mesh(mesh_shape)
    model = OpModule(fn, specs, seed=0)
    ref_out = _leaves(model())
    weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(1)) for o in ref_out]
    model.zero_grad()
    loss = sum((o * w).sum() for o, w in zip(ref_out, weights) if o.dtype.is_floating_point)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    traced = ColoTracer().trace(model, ())
    gen = StrategyGenerator(mesh_shape)
    strategies = gen.generate(traced.gm)
    assert not gen.fallbacks, f"{name}: ops without a rule: {dict(gen.fallbacks)}"
    planner = Planner(traced.gm, strategies, gen.aliases, MeshSpec(mesh_shape), CostModel(),
                      dict(traced.params, **traced.buffers))
    repl = (R,) * len(mesh_shape)
    base = {}
    for node, ss in strategies.items():
        base[node] = next(s for s in ss if all(x == repl for x in s.outputs + s.inputs))
    checked = 0
    for node, ss in strategies.items():
        if node.op != "call_function":
            continue
        seen_targets.add(node.target)
        for s in ss:
            choice = dict(base)
            choice[node] = s
            if not _match_in_place(choice, node, strategies, planner):
                continue  # no plan can use it: an in-place op would write into a converted copy
            plan = planner.make_plan(choice)
            with LocalTensorMode(frozenset(range(mesh.size()))):
                pmodel = emit(model, traced, plan, mesh)
                outs = _leaves(pmodel())
                what = f"{name} on {mesh_shape}: {node.name} ({node.target}) under {plan.nodes[node.name].specs_str()}"
                for o, r in zip(outs, ref_out):
                    for v in _ranks(o.detach()):
                        torch.testing.assert_close(v, r.detach(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")
                loss = sum((o * w).sum() for o, w in zip(outs, weights) if o.dtype.is_floating_point)
                if ref_grads and isinstance(loss, torch.Tensor) and loss.requires_grad:
                    loss.backward()
                    for pname, p in pmodel.named_parameters():
                        if ref_grads.get(pname) is None:
                            continue
                        for v in _ranks(p.grad.full_tensor()):
                            torch.testing.assert_close(v, ref_grads[pname], rtol=1e-4, atol=1e-5,
                                                       msg=lambda m: f"{what}, grad of {pname}: {m}")
            checked += 1
    assert checked > 0
    return gen


_SEEN: set = set()


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_strategy_matches_the_dense_op(name, mesh_shape, sim_mesh):
    _check_all_strategies(name, mesh_shape, sim_mesh, _SEEN)


def test_every_rule_has_a_sample():
    """Runs last in this module: every rule function and replicated-by-rule op was exercised."""
    if len(_SEEN) == 0:
        pytest.skip("run together with test_every_strategy_matches_the_dense_op")
    by_code: dict = {}
    for op, fn in RULES.items():
        by_code.setdefault(getattr(fn, "__code__", fn), set()).add(op)
    missing = [sorted(map(str, ops))[:3] for code, ops in by_code.items() if not ops & _SEEN]
    assert not missing, f"rules without a sample in tests/test_rules.py: {missing}"
    assert REPLICATE_ONLY & _SEEN
