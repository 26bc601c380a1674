"""Arguments are checked where the user passes them: TypeError or ValueError naming the
argument, the value given and what was expected, before any work is done."""

import contextlib
import math

import numpy as np
import pytest
import torch

import autoparallel
from autoparallel import CostModel, DevicePreset, MeshSpec

LIN = torch.nn.Linear(4, 4)
META = (torch.empty(2, 4, device="meta"),)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"shape": ()}, ValueError, r"shape must have at least one axis.*\(\)"),
    ({"shape": (2, 0)}, ValueError, r"every axis at least 1 device, got \(2, 0\)"),
    ({"shape": (2.0,)}, TypeError, r"shape must be an int or a sequence of ints.*\(2\.0,\)"),
    ({"shape": "22"}, TypeError, "shape must be an int or a sequence of ints"),
    ({"shape": (True, 2)}, TypeError, "shape must be an int or a sequence of ints"),
    ({"shape": (2, 2), "axis_names": ("dp", "dp")}, ValueError, r"axis_names must be distinct.*\('dp', 'dp'\)"),
    ({"shape": (2, 2), "axis_names": ("dp", "")}, ValueError, "distinct non-empty"),
    ({"shape": (2, 2), "axis_names": ("dp",)}, ValueError, "1 names for a 2-axis mesh"),
    ({"shape": (2, 2), "axis_names": "dp"}, TypeError, "axis_names must be a sequence of strings"),
    ({"shape": (2, 2), "axis_names": (0, 1)}, TypeError, "axis_names must be a sequence of strings"),
    ({"shape": (4,), "beta": -1}, ValueError, "beta must be positive and finite on every axis, got -1"),
    ({"shape": (4,), "beta": 0}, ValueError, "beta must be positive"),
    ({"shape": (4,), "alpha": math.inf}, ValueError, "alpha must be positive and finite"),
    ({"shape": (4,), "alpha": math.nan}, ValueError, "alpha must be positive and finite"),
    ({"shape": (2, 2), "alpha": (1e-6, -1e-6)}, ValueError, "alpha must be positive"),
    ({"shape": (2, 2), "beta": (1e-9,)}, ValueError, "beta has 1 entries but the mesh has 2 axes"),
    ({"shape": (4,), "alpha": "5us"}, TypeError, "alpha must be a number or one number per mesh axis, not '5us'"),
    ({"shape": (4,), "beta": True}, TypeError, "beta must be a number"),
])
def test_meshspec_rejects(kwargs, error, match):
    with pytest.raises(error, match=match):
        MeshSpec(**kwargs)


def test_meshspec_accepts_int_numpy_and_torch_sizes():
    assert MeshSpec(4).shape == (4,)
    assert MeshSpec(np.array([2, 2])).shape == (2, 2)
    assert MeshSpec(torch.Size([2, 4]), alpha=np.float32(1e-5), beta=[1e-9, 2e-9]).beta == (1e-9, 2e-9)
    assert MeshSpec((2, 2), axis_names=["dp", "tp"]).axis_names == ("dp", "tp")


@pytest.mark.parametrize("kwargs, error, match", [
    ({"mesh_shape": "2x2"}, TypeError, r"mesh_shape must be an int or a sequence of ints such as \(2, 4\), not '2x2'"),
    ({"mesh_shape": (2, -1)}, ValueError, r"mesh_shape must have .* at least 1 device, got \(2, -1\)"),
    ({"mesh_shape": 2.5}, TypeError, "mesh_shape must be an int or a sequence of ints"),
    ({}, ValueError, "needs one of mesh_shape=.* got neither"),
    ({"mesh_shape": (2,), "mesh": MeshSpec(2)}, ValueError, "not both"),
    ({"mesh": (2,)}, TypeError, r"mesh must be an autoparallel.MeshSpec, not \(2,\)"),
    ({"mesh_shape": 2, "cost_model": "h100"}, TypeError, "cost_model must be an autoparallel.CostModel.*'h100'"),
    ({"mesh_shape": 2, "solver": "gurobi"}, ValueError, "solver must be one of 'cbc', 'highs', not 'gurobi'"),
    ({"mesh_shape": 2, "time_limit": 0}, ValueError, "time_limit must be a positive, finite number of seconds, not 0"),
    ({"mesh_shape": 2, "time_limit": "60"}, TypeError, "time_limit must be a number of seconds, not '60'"),
    ({"mesh_shape": 2, "parallelism": "tensor"}, ValueError, "parallelism must be 'auto', 'data' or 'fsdp', not 'tensor'"),
    ({"mesh_shape": 2, "strict": "yes"}, TypeError, "strict must be True or False, not 'yes'"),
    ({"mesh_shape": 2, "share_layers": None}, TypeError, "share_layers must be True or False"),
    ({"mesh_shape": 2, "stamp_layers": 1}, TypeError, "stamp_layers must be True or False"),
    ({"mesh_shape": 2, "cache_dir": True}, TypeError, "cache_dir must be a folder .* not True"),
    ({"mesh_shape": 2, "memory_budget": -5}, ValueError, "memory budget must be positive, got -5"),
    ({"mesh_shape": 2, "memory_budget": "lots"}, ValueError, "cannot read memory budget 'lots'"),
    ({"mesh_shape": 2, "memory_budget": [1]}, TypeError, r"memory_budget must be bytes .* not \[1\]"),
    ({"mesh_shape": 2, "memory_budget": math.inf}, ValueError, "memory_budget must be a finite number of bytes"),
    ({"mesh_shape": 2, "optimizer": "lion"}, ValueError, "optimizer must be one of .*'adamw'.* not 'lion'"),
    ({"mesh_shape": 2, "device": torch.device("cpu")}, TypeError, "device must be a device type string"),
])
def test_plan_rejects(kwargs, error, match, monkeypatch):
    def no_capture(*args, **kw):
        raise AssertionError("the arguments are checked before the capture")

    monkeypatch.setattr(autoparallel.tracer.ColoTracer, "trace", no_capture)
    old_name = pytest.warns(DeprecationWarning, match="mesh_spec=") if "mesh" in kwargs else contextlib.nullcontext()
    with pytest.raises(error, match=match), old_name:
        autoparallel.plan(LIN, META, **kwargs)


@pytest.mark.parametrize("model, inputs, match", [
    ("not a model", META, "model must be a torch.nn.Module, not str"),
    (LIN, torch.empty(2, 4, device="meta"), r"meta_inputs must be a dict .* not Tensor \(wrap a single tensor x"),
])
def test_plan_rejects_model_and_inputs(model, inputs, match):
    with pytest.raises(TypeError, match=match):
        autoparallel.plan(model, inputs, mesh_shape=2)


def test_plan_takes_an_int_mesh_shape():
    assert autoparallel.plan(LIN, META, mesh_shape=2, cache_dir=False).mesh.shape == (2,)


@pytest.mark.parametrize("device, error, match", [
    ("tpu", ValueError, r"unknown device preset 'tpu'; choose one of \['a100', 'cpu', 'h100'\]"),
    (7, TypeError, "CostModel: device must be a preset name .* or a DevicePreset, not 7"),
])
def test_cost_model_rejects(device, error, match):
    with pytest.raises(error, match=match):
        CostModel(device)


@pytest.mark.parametrize("field, value, error, match", [
    ("flops_fp32", 0, ValueError, "flops_fp32 must be positive and finite, got 0"),
    ("mem_bw", -1e12, ValueError, "mem_bw must be positive"),
    ("memory", math.inf, ValueError, "memory must be positive and finite"),
    ("flops_half", "1e15", TypeError, "flops_half must be a number, not '1e15'"),
    ("name", None, TypeError, "name must be a string"),
])
def test_device_preset_rejects(field, value, error, match):
    fields = {"name": "mine", "flops_fp32": 1e14, "flops_half": 2e14, "mem_bw": 1e12, "memory": 2**34, field: value}
    with pytest.raises(error, match=match):
        DevicePreset(**fields)


def test_plan_takes_mesh_spec_and_the_old_keyword_with_a_warning():
    """plan() names the mesh description mesh_spec=, as autoparallelize() does; mesh= still works, warned."""
    import warnings

    from autoparallel import MeshSpec, plan
    from models import MLP

    model = MLP(hidden=16, layers=2)
    inputs = {"x": torch.empty(8, 16, device="meta"), "y": torch.empty(8, 16, device="meta")}
    new = plan(model, inputs, mesh_spec=MeshSpec((2,)), cache_dir=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = plan(model, inputs, mesh=MeshSpec((2,)), cache_dir=False)
    assert any(issubclass(w.category, DeprecationWarning) and "mesh_spec" in str(w.message) for w in caught)
    assert old.nodes == new.nodes and old.redistributions == new.redistributions
    with pytest.raises(ValueError, match="mesh_spec= only"), pytest.warns(DeprecationWarning, match="mesh_spec="):
        plan(model, inputs, mesh=MeshSpec((2,)), mesh_spec=MeshSpec((2,)), cache_dir=False)
    with pytest.warns(DeprecationWarning, match="share_layers="):
        unshared = plan(model, inputs, mesh_shape=(2,), share_blocks=False, cache_dir=False)
    assert unshared.solver_stats.shared_nodes == 0
