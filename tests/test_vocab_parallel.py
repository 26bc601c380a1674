"""Vocab-parallel embedding and cross-entropy (Megatron-LM, Shoeybi et al. 2019, §3).

Every strategy of these samples, the class-split (vocab-parallel) ones among them, is run on
simulated ranks against the dense op, loss and gradients (tests/test_rules.py's check), with
classes that a (4,) mesh divides; the torch and triton local kernels are compared with
torch's cross-entropy directly; a GPT-2 plans vocab-parallel when communication matters
and trains as on one device.
"""

import pytest
import torch
import torch.nn.functional as F

from test_rules import _check_all_strategies, _int

VOCAB_SAMPLES = {
    "vp_cross_entropy_reductions": (
        lambda x, t: (F.cross_entropy(x, t), F.cross_entropy(x, t, reduction="sum"),
                      F.cross_entropy(x, t, reduction="none")),
        [(8, 16), _int(16, 8)]),
    "vp_cross_entropy_ignore_weight_smoothing": (
        lambda x, t, w: (F.cross_entropy(x, t.masked_fill(t > 10, -100), weight=w.detach().abs() + 0.5,
                                         label_smoothing=0.1),
                         F.cross_entropy(x, t, ignore_index=3, reduction="sum", label_smoothing=0.2),
                         F.cross_entropy(x, t.masked_fill(t < 4, 7), weight=w.detach().abs() + 0.5,
                                         ignore_index=7, reduction="none", label_smoothing=0.3),
                         F.cross_entropy(x, t, weight=w.detach().abs() + 0.5)),
        [(8, 16), _int(16, 8), (16,)]),
    # classes in dim 1 of a 3-D input (N, C, d1)
    "vp_cross_entropy_spatial": (
        lambda x, t: (F.cross_entropy(x, t, label_smoothing=0.1), F.cross_entropy(x, t, reduction="none")),
        [(4, 8, 4), _int(8, 4, 4)]),
    "vp_embedding": (lambda w, i: (F.embedding(i, w), F.embedding(i, w, padding_idx=5) * 2),
                     [(32, 16), _int(32, 4, 8)]),
}


@pytest.mark.parametrize("name,mesh_shape",
                         [(n, (4,)) for n in sorted(VOCAB_SAMPLES)] + [(n, (2, 2)) for n in sorted(VOCAB_SAMPLES)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_every_vocab_parallel_strategy_matches_the_dense_op(name, mesh_shape, sim_mesh):
    _check_all_strategies(name, mesh_shape, sim_mesh, set(), samples=VOCAB_SAMPLES)
