"""Parity on more Hugging Face families (decoders, BERT relatives, ViT) on every mesh, and
their coverage reports."""

import pytest

import autoparallel
from models import FAMILIES, batch_for, hf_model, to_meta
from test_parity import MESHES, test_parity as _parity_check

pytest.importorskip("transformers")


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_parity(name, mesh_shape, sim_mesh):
    _parity_check(name, mesh_shape, "cpu", sim_mesh)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_coverage(name):
    report = autoparallel.coverage(hf_model(name), to_meta(batch_for(name, 0)))
    counts = report.counts()
    print(name, counts)
    assert counts.get("rule", 0) > 10 and sum(counts.values()) == len(report.rows)
