"""The per-device graph of a pipelined plan cut into its pipeline stages.

Each node belongs to one stage (:func:`traced_stages`): an op in layer ``i`` to the stage that
runs layer ``i``, any other op to the latest stage among its inputs' (what runs before the
layers is stage 0's, what runs after them the last stage's), and a value computed from
parameters and constants alone (a parameter's local shard, its gradient bucket, a constant)
to the earliest stage that reads it. :func:`split_stages` then makes one graph per stage: it
takes the mesh coordinate and the values earlier stages computed that it or a later stage
reads (the model's inputs for stage 0), in graph order, and returns those a later stage
reads; the last returns the model's loss. Stage ``s``'s outputs are stage ``s + 1``'s inputs,
which is what ``torch.distributed.pipelining.PipelineStage`` sends between them.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..errors import AutoParallelError
from ..pipeline_plan import PipelinePlan
from ..tracer.annotate import node_info
from ..tracer.untie import piece_of


def _static(graph: fx.Graph) -> set[fx.Node]:
    """Nodes computed from parameters, buffers, constants and the mesh coordinate alone."""
    out: set[fx.Node] = set()
    first = next(iter(graph.nodes))
    for n in graph.nodes:
        if n.op == "get_attr" or n is first and n.op == "placeholder" and n.name == "mesh_coord" or \
                n.op == "call_function" and all(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _assign(graph: fx.Graph, own_stage, last: int) -> dict[fx.Node, int]:
    """Node → stage: ``own_stage(node)`` (or ``None``) raised to its inputs' latest stage;
    static nodes (:func:`_static`) at their earliest reader's; the output at ``last``."""
    static = _static(graph)
    stage: dict[fx.Node, int] = {}
    for n in graph.nodes:
        if n in static:
            continue
        s = max((stage[a] for a in n.all_input_nodes if a not in static), default=0)
        own = own_stage(n)
        stage[n] = last if n.op == "output" else max(s, own) if own is not None else s
    for n in reversed(list(graph.nodes)):
        if n in static:
            stage[n] = min((stage[u] for u in n.users), default=0)
    return stage


def traced_stages(gm: fx.GraphModule, pipeline: PipelinePlan) -> dict[str, int]:
    """Captured node name → the pipeline stage that runs it (module docstring)."""
    def own(n: fx.Node):
        if n.op != "call_function":
            return None
        layer = piece_of(node_info(n).module_path, pipeline.layers)
        return pipeline.stage_of_layer(layer) if layer is not None else None

    return {n.name: s for n, s in _assign(gm.graph, own, pipeline.stages - 1).items()}


def loss_index(gm: fx.GraphModule) -> int:
    """Which flat output of the captured ``gm`` the schedule backpropagates: the first 0-d
    floating value returned.

    Raises:
        AutoParallelError: the model returns no scalar loss."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    for i, v in enumerate(output.args[0]):
        val = v.meta.get("val") if isinstance(v, fx.Node) else None
        if isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype.is_floating_point:
            return i
    raise AutoParallelError("a pipelined model must compute its loss in its forward (a 0-d floating output, "
                            "e.g. pass labels to a Hugging Face causal LM): the last stage backpropagates from it")


def loss_dtype(gm: fx.GraphModule) -> torch.dtype:
    """The dtype of the loss :func:`loss_index` picks."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return output.args[0][loss_index(gm)].meta["val"].dtype


def split_stages(gm: fx.GraphModule, source_stage: dict[str, int], stages: int, loss: int) -> list[fx.GraphModule]:
    """The per-device graph ``gm`` (lowered from a traced graph whose nodes' stages are
    ``source_stage``; emitted nodes name theirs in ``meta["source"]``) as one graph module per
    stage, each over ``gm``'s attributes (module docstring); the last returns flat output
    ``loss`` (:func:`loss_index`)."""
    nodes = list(gm.graph.nodes)
    coord, inputs = nodes[0], [n for n in nodes[1:] if n.op == "placeholder"]
    output = nodes[-1]
    stage = _assign(gm.graph, lambda n: source_stage.get(n.meta.get("source")), stages - 1)
    carried: list[fx.Node] = inputs
    out: list[fx.GraphModule] = []
    for s in range(stages):
        graph = fx.Graph()
        env = {coord: graph.placeholder(coord.name)}
        for v in carried:
            env[v] = graph.placeholder(v.name)
        mine = [n for n in nodes if n.op not in ("placeholder", "output") and stage[n] == s]
        for n in mine:
            env[n] = graph.node_copy(n, lambda a: env[a])
        if s == stages - 1:
            graph.output(env[output.args[0][loss]])
        else:
            carried = [v for v in carried + mine if any(stage[u] > s for u in v.users)]
            graph.output(tuple(env[v] for v in carried))
        out.append(fx.GraphModule(gm, graph, class_name=f"Stage{s}"))
    return out
