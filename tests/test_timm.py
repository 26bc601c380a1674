"""timm models: parity of a small timm ViT trained with cross-entropy on every mesh (ResNet-18
in training mode: tests/test_batchnorm.py), and their coverage reports. timm needs torchvision, whose PyPI wheel imports on CPU torch only through
``autoparallel._torchvision_compat`` (installed by ``import autoparallel`` and conftest)."""

import pytest
from torch.distributed.tensor import Shard

import autoparallel
from autoparallel.strategies.coverage import FALLBACK, REGISTRY, REPLICATED_BY_RULE, RULE
from models import batch_for, build_model, placements_of, to_meta
from test_families import _splits
from test_parity import MESHES, run_parity

timm = pytest.importorskip("timm")

# two SGD steps between three checks, as in test_families: planning dominates the time
STEPS = 3


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_timm_vit_parity(mesh_shape, sim_mesh):
    pmodel = run_parity("timm_vit", mesh_shape, "cpu", sim_mesh, steps=STEPS)
    assert _splits(pmodel.plan), "the plan should split some tensor"


@pytest.mark.slow
def test_timm_vit_parity_shard_params(sim_mesh):
    """Parameters split wherever the planner can (timm's fused qkv, reshaped to heads and
    unbound): the tensor-parallel rules on a model written outside transformers."""
    pmodel = run_parity("timm_vit", (2, 2), "shard-params", sim_mesh, steps=STEPS)
    split_params = [n for n, p in pmodel.named_parameters() if any(isinstance(x, Shard) for x in placements_of(p))]
    assert split_params, "ShardParams should split some parameter"


@pytest.mark.parametrize("name, ops", [
    ("timm_vit", {"aten.conv2d.default", "aten.linear.default", "aten.layer_norm.default",
                  "aten.scaled_dot_product_attention.default", "aten.cross_entropy_loss.default"}),
    ("timm_resnet18", {"aten.conv2d.default", "aten.max_pool2d.default", "aten.rsqrt.default",
                       "aten.relu_.default", "aten.linear.default", "aten.cross_entropy_loss.default"}),
])
def test_timm_coverage(name, ops):
    report = autoparallel.coverage(build_model(name), to_meta(batch_for(name, 0)))
    counts = report.counts()
    print(report)
    assert report.rows and sum(counts.values()) == len(report.rows)
    for row in report.rows:  # every op says where its strategies come from, and where it is used
        assert row.source in {RULE, REPLICATED_BY_RULE, REGISTRY, FALLBACK}, row
        assert row.nodes > 0 and row.modules, row
    assert ops <= {r.op for r in report.rows}, str(report)
    assert counts.get(RULE, 0) > 10
    assert not counts.get(FALLBACK), str(report)
