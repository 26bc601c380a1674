"""PlanOptions: one options object, built from keywords or passed whole, validated once."""

import dataclasses
import inspect

import pytest
import torch

import autoparallel
from autoparallel import PlanOptions
from models import MLP, batch_for, to_meta


def test_defaults_are_written_once():
    """The public functions take the options as keywords without restating their defaults."""
    fields = {f.name for f in dataclasses.fields(PlanOptions)}
    for fn in (autoparallel.plan, autoparallel.compare, autoparallel.autoparallelize):
        assert not fields & set(inspect.signature(fn).parameters), fn.__name__


@pytest.mark.parametrize("kw, error, match", [
    ({"memory_budjet": "1GiB"}, TypeError, "unknown option 'memory_budjet'; did you mean memory_budget"),
    ({"solver": "gurobi"}, ValueError, "solver must be one of"),
    ({"time_limit": 0}, ValueError, "time_limit must be a positive"),
    ({"baselines": "yes"}, TypeError, "baselines must be True or False"),
    ({"memory_budget": "12 parsecs"}, ValueError, "cannot read memory budget"),
])
def test_bad_options_raise_before_any_work(kw, error, match):
    with pytest.raises(error, match=match):
        autoparallel.plan(MLP(), to_meta(batch_for("mlp", 0)), mesh_shape=(2,), **kw)


def test_an_options_object_and_keywords_give_the_same_plan():
    inputs = to_meta(batch_for("mlp", 0))
    options = PlanOptions(cache_dir=False, memory_budget="unlimited", time_limit=30)
    by_object = autoparallel.plan(MLP(), inputs, mesh_shape=(2,), options=options)
    by_keywords = autoparallel.plan(MLP(), inputs, mesh_shape=(2,), cache_dir=False, memory_budget="unlimited",
                                    time_limit=30)
    assert by_object.param_placements == by_keywords.param_placements
    assert by_object.estimate.step_time_s == by_keywords.estimate.step_time_s
    # keywords replace the object's fields; the object itself is not changed (it is frozen)
    replaced = autoparallel.plan(MLP(), inputs, mesh_shape=(2,), options=options, parallelism="data")
    assert all(p == (torch.distributed.tensor.Replicate(),) for p in replaced.param_placements.values())
    assert options.parallelism == "auto"
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.solver = "highs"


def test_deprecated_name_warns_and_maps():
    with pytest.warns(DeprecationWarning, match="share_blocks"):
        assert PlanOptions.build(None, "plan", share_blocks=False).share_layers is False
    with pytest.raises(ValueError, match="give share_layers= only"), pytest.warns(DeprecationWarning):
        PlanOptions.build(None, "plan", share_blocks=False, share_layers=True)


def test_the_cache_key_holds_what_changes_a_plan():
    a, b = PlanOptions(), PlanOptions(time_limit=5, cache_dir=False)
    assert a.cache_key(None) == b.cache_key(None)  # neither changes the plan of a solve that finishes
    assert a.cache_key(None) != PlanOptions(parallelism="data").cache_key(None)
    assert a.cache_key(None) != a.cache_key(2**30)
