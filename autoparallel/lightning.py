"""A Lightning strategy that trains a LightningModule with a planned model:
``Trainer(strategy=AutoParallelStrategy(meta_inputs), devices=N)``.

It is Lightning's own :class:`~lightning.pytorch.strategies.ModelParallelStrategy` (FSDP2 and
tensor parallelism written by hand in ``configure_model``) with the parallelism planned
instead: the strategy starts the processes and the process group, builds the device mesh,
and in :meth:`AutoParallelStrategy.setup` calls :func:`autoparallel.autoparallelize` on one
submodule of the LightningModule (``lightning_module.model`` by default) before Lightning
calls ``configure_optimizers``, so the optimizer holds the parallel parameters. Checkpoints,
``reduce``/``barrier``/``broadcast`` and gradient clipping by norm (on DTensor gradients) are
the parent's; this module adds the planning, the launcher of ``start_method="spawn"``, the
sampler of the plan's inputs, ``no_sync`` for gradient accumulation, loading checkpoints
of plans that keep plain tensors, and training through ``model.step()`` (pipeline stages).

Lightning is an optional dependency (``pip install autoparallel[lightning]``):
``import autoparallel`` does not import this module.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Generator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.fsdp import _distributed_checkpoint_load
from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint, _rekey_optimizer_state_if_needed
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.strategies.model_parallel import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from .api import autoparallelize
from .codegen import ParallelModule
from .fqn import get_attr
from .solver.stages import PP_AXIS

__all__ = ["AutoParallelStrategy"]


class AutoParallelStrategy(ModelParallelStrategy):
    """Train a LightningModule whose submodule ``module`` is parallelized by
    :func:`autoparallel.autoparallelize` over all devices of the Trainer.

    What is parallelized: the submodule at attribute path ``module`` (default ``"model"``:
    ``self.model`` of the LightningModule), in place, in :meth:`setup`, once (a later
    ``fit``/``validate`` with the same LightningModule reuses it). Its ``forward`` must return
    what ``training_step`` backpropagates, the loss, computed from the batch inside it
    (``self.model(x, y)``, a Hugging Face model called with ``labels``): with the default
    ``inputs="local"`` each rank passes its own batch and the module computes on the global
    batch, so a loss computed outside it from a local target would mix the two. A plan with
    pipeline stages (a mesh axis named ``"pp"``, or ``pipeline="auto"``) trains only through
    ``return self.model.step(*batch)`` in ``training_step``, which serves every plan: its
    gradients are kept from Lightning's ``zero_grad`` (:meth:`training_step`), clipping by
    norm takes every stage's, and every rank reads the global batch (``inputs="global"``).

    Args:
        meta_inputs: the submodule's call arguments as meta tensors (dict of keyword arguments
            or tuple of positional ones), with the shapes **one rank** passes under the default
            ``inputs="local"`` (the DataLoader's ``batch_size``), or a function of the
            LightningModule returning them. Non-tensor arguments are planned for as given.
        module: attribute path of the submodule to parallelize (``"model"``, ``"net.backbone"``).
        mesh_shape: devices per mesh axis (default: one axis over every process,
            ``(world_size,)``); its product must be the world size.
        mesh_dim_names: names of the mesh axes, as the plan prints them (default
            ``dim0, dim1, ...``).
        save_distributed_checkpoint: ``True`` (the parent's default): every rank writes its
            shards with ``torch.distributed.checkpoint`` into a folder. ``False``: rank 0
            writes one ordinary Lightning checkpoint file of whole tensors, which a plain
            LightningModule (``load_from_checkpoint``, another strategy) loads too.
        start_method: ``"popen"`` (default, as DDP: the script is run again per rank, or the
            processes come from ``torchrun``), ``"spawn"``, ``"fork"`` or ``"forkserver"``
            (``ddp_spawn``'s launcher: after ``fit`` the main process's LightningModule gets
            the trained weights, whole).
        process_group_backend, timeout: as DDP's (default backend: gloo on CPU, NCCL on GPU).
        autoparallel_options: any keyword of :func:`autoparallel.autoparallelize` and
            :class:`autoparallel.PlanOptions` (``memory_budget="12GiB"``, ``cost_model=``,
            ``mp_policy=``, ``replan=``, ``plan=``, ...); ``inputs`` defaults to ``"local"``
            (Lightning's DistributedSampler gives every rank its own batch), unless given as
            a keyword, by ``options=PlanOptions(...)`` (whose own default is ``"global"``) or by
            a ``plan``, and is ``"global"`` when ``mesh_dim_names`` holds ``"pp"`` or
            ``pipeline="auto"``; under ``"global"`` every rank draws the same batch, of
            ``meta_inputs``' shapes.

    Raises (in ``Trainer.fit``/``validate``):
        AttributeError: the LightningModule has no submodule ``module``.
        TypeError: ``module`` names no ``nn.Module``; precision other than ``"32-true"`` (pass
            ``mp_policy=MixedPrecisionPolicy(...)`` for mixed precision).
        ValueError: ``mesh_shape`` whose product is not the world size.
        The errors of :func:`autoparallel.autoparallelize`.
    """

    def __init__(self, meta_inputs: Any, *, module: str = "model", mesh_shape: tuple[int, ...] | int | None = None,
                 mesh_dim_names: tuple[str, ...] | None = None, save_distributed_checkpoint: bool = True,
                 start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 **autoparallel_options: Any) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"start_method must be 'popen', 'spawn', 'fork' or 'forkserver', not {start_method!r}")
        self._meta_inputs = meta_inputs
        self._module_path = module
        self._mesh_shape = (mesh_shape,) if isinstance(mesh_shape, int) else mesh_shape
        self._mesh_dim_names = mesh_dim_names
        self._start_method = start_method
        if "inputs" not in autoparallel_options and autoparallel_options.get("options") is None:
            # else the keyword or the PlanOptions says; pipeline stages read the global batch
            staged = PP_AXIS in (mesh_dim_names or ()) or autoparallel_options.get("pipeline") == "auto"
            autoparallel_options["inputs"] = "global" if staged else "local"
        self._autoparallel_options = autoparallel_options
        self._held_grads: list | None = None  # (parameter, gradient) of a step() until backward()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Under ``inputs="local"`` every rank draws its own batch (the global batch is the
        ranks' batches in rank order); under ``inputs="global"`` every rank draws the same one."""
        if self._inputs() == "global":
            return {"num_replicas": 1, "rank": 0}
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _inputs(self) -> str:
        """The ``inputs`` the module is planned for: a given ``plan``'s, else the keyword, else
        ``options``'."""
        opts = self._autoparallel_options
        plan = opts.get("plan")
        if plan is not None:
            from .plan import Plan

            return (Plan.from_json(plan) if isinstance(plan, str) else plan).inputs
        return opts["inputs"] if "inputs" in opts else opts["options"].inputs

    @property
    def parallel_module(self) -> ParallelModule:
        """The parallelized submodule (after :meth:`setup`)."""
        found = get_attr(self.lightning_module, self._module_path)
        if not isinstance(found, ParallelModule):
            raise RuntimeError(f"{self._module_path!r} is not parallelized yet: the strategy does it in setup()")
        return found

    def _configure_launcher(self) -> None:
        if self._start_method == "popen":
            super()._configure_launcher()  # _SubprocessScriptLauncher, unless processes come from torchrun
        else:
            self._launcher = _AutoParallelSpawnLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        """The process group (the parent's ``_setup_distributed``) and the device mesh, built
        once per strategy and handed to the LightningModule (``self.device_mesh`` in its hooks)."""
        from torch.distributed.device_mesh import init_device_mesh

        self._setup_distributed()
        if self._device_mesh is None:
            shape = tuple(self._mesh_shape or (self.world_size,))
            if torch.Size(shape).numel() != self.world_size:
                raise ValueError(f"mesh_shape {shape} has {torch.Size(shape).numel()} devices but the Trainer runs "
                                 f"{self.world_size} processes (devices x num_nodes)")
            self._device_mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=self._mesh_dim_names)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def setup(self, trainer) -> None:
        """ModelParallelStrategy's setup with :func:`autoparallelize` where it requires
        ``configure_model``: materialize and move the model, parallelize the submodule, then
        (when fitting) ``configure_optimizers`` over the parallel parameters."""
        from lightning.fabric.utilities.init import _materialize_distributed_module
        from lightning.fabric.utilities.optimizer import _optimizers_to_device

        assert self.model is not None and self.accelerator is not None
        if self.precision_plugin.precision != "32-true":
            raise TypeError(f"{type(self).__name__} plans the model's own dtypes: use Trainer(precision='32-true') "
                            "and pass mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16) to the strategy "
                            f"for mixed precision (got precision={self.precision_plugin.precision!r})")
        self.accelerator.setup(trainer)
        if type(self.precision_plugin) is Precision:  # "32-true": clipping by the whole model's norm
            self.precision_plugin = _WholeModelNorm(self)
        _materialize_distributed_module(self.model, self.root_device)
        self.model_to_device()
        self.model = self._setup_model(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        """Parallelize the submodule ``module`` of ``model`` in place (once: a submodule
        already parallel, from an earlier ``fit``, is kept); returns ``model``."""
        target = get_attr(model, self._module_path)
        if not isinstance(target, nn.Module):
            raise TypeError(f"{type(self).__name__}(module={self._module_path!r}) must name a torch.nn.Module of "
                            f"the LightningModule, not {type(target).__name__}")
        if isinstance(target, ParallelModule):
            return model
        meta = self._meta_inputs(model) if callable(self._meta_inputs) else self._meta_inputs
        autoparallelize(target, meta, device_mesh=self.device_mesh, **self._autoparallel_options)
        return model

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``training_step``. Under automatic optimization, one that
        trains through ``model.step(...)`` (which runs the backward: a pipelined plan trains
        only through it) starts from no gradients, as the backward Lightning runs after
        ``zero_grad`` does, and the gradients it leaves are held until :meth:`backward`, out
        of reach of that ``zero_grad``; the last step's stay for it."""
        modules = [m for m in self.lightning_module.modules() if isinstance(m, ParallelModule)]
        if not self.lightning_module.automatic_optimization or not modules:
            return super().training_step(*args, **kwargs)
        last = [(p, p.grad) for m in modules for p in m.parameters()]
        for p, _ in last:
            p.grad = None
        out = super().training_step(*args, **kwargs)
        stepped = [m for m in modules if m._ap.stepped]
        for m in stepped:
            m._ap.stepped = False
        if stepped:
            self._held_grads = [(p, p.grad) for m in stepped for p in m.parameters()]
        for p, grad in last:
            if stepped or p.grad is None:
                p.grad = grad
        return out

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The parent's backward; after a training step through ``model.step(...)``, its
        gradients put back and the hooks alone (``on_before_backward``, ``on_after_backward``),
        plus the backward of whatever else the returned loss requires grad through.

        Raises:
            MisconfigurationException: ``Trainer(accumulate_grad_batches=k > 1)`` with
                ``step()``: Lightning divides the loss by ``k`` before its backward, which
                ``step()`` has run undivided (a pipeline accumulates over its microbatches:
                raise ``microbatches`` instead)."""
        held, self._held_grads = self._held_grads, None
        if held is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        if self.lightning_module.trainer.accumulate_grad_batches > 1:
            raise MisconfigurationException(
                "model.step() runs the backward of its loss undivided, and Trainer(accumulate_grad_batches=k) "
                "needs it divided by k: call the module and return its loss (unpipelined plans), or accumulate "
                "over more microbatches (autoparallel's microbatches=)")
        for p, grad in held:
            p.grad = grad
        if closure_loss.requires_grad:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation (``Trainer(accumulate_grad_batches=k)``): the parallel
        submodules' ``no_sync``, as DDP's."""
        with ExitStack() as stack:
            for m in self.lightning_module.modules():
                if isinstance(m, ParallelModule):
                    stack.enter_context(m.no_sync())
            yield

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the model and optimizer states of a checkpoint written by :meth:`save_checkpoint`
        (either kind) into the parallel module and the optimizers; returns the rest for
        Lightning (loops, schedulers, callbacks). The parent's loader refuses a model that holds
        no DTensor (a plan that replicates every parameter), so it is written here for both.
        A full checkpoint is read by every rank; its whole tensors are sharded by the parallel
        module's ``load_state_dict`` (rank 0's values) and by
        ``set_optimizer_state_dict(full_state_dict=True)``."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict, set_optimizer_state_dict)

        path = Path(self.broadcast(checkpoint_path))
        model = self.lightning_module
        strict = model.strict_loading
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        if _is_sharded_checkpoint(path):
            state = {"state_dict": get_model_state_dict(model)}
            _distributed_checkpoint_load(state, path)
            model.load_state_dict(state["state_dict"], strict=strict)
            for i, optimizer in enumerate(optimizers):
                state = {f"optimizer_{i}": get_optimizer_state_dict(model, optimizer)}
                _distributed_checkpoint_load(state, path)
                set_optimizer_state_dict(model, optimizer, optim_state_dict=state[f"optimizer_{i}"],
                                         options=StateDictOptions(cpu_offload=True))
            return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is neither a checkpoint file nor a folder of checkpoint shards")
        checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only)
        model.load_state_dict(checkpoint.pop("state_dict"), strict=strict)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
        for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states", [])):
            set_optimizer_state_dict(model, optimizer, optim_state_dict=_rekey_optimizer_state_if_needed(state, model),
                                     options=options)
        return checkpoint


class _WholeModelNorm(Precision):
    """Full precision whose clipping by norm takes the whole model's norm: a pipelined module's
    :meth:`~autoparallel.codegen.ParallelModule.clip_grad_norm_` (every stage's gradients,
    combined over the pipeline axis); torch's ``clip_grad_norm_`` otherwise, as the parent's."""

    def __init__(self, strategy: AutoParallelStrategy) -> None:
        super().__init__()
        self._strategy = strategy

    def clip_grad_by_norm(self, optimizer, clip_val: float) -> None:
        """Raises:
            ValueError: a pipelined module's optimizer holding other parameters than the
                module's own (the norm would leave them out, or count them once per stage)."""
        module = self._strategy.parallel_module
        if module.plan.pipeline is None:
            return super().clip_grad_by_norm(optimizer, clip_val)
        if {id(p) for p in self.main_params(optimizer)} != {id(p) for p in module.parameters()}:
            raise ValueError(f"gradient clipping by norm of a pipelined module takes the norm over its stages: the "
                             f"optimizer must hold exactly the parameters of {self._strategy._module_path!r}")
        module.clip_grad_norm_(clip_val)


class _AutoParallelSpawnLauncher(_MultiProcessingLauncher):
    """``ddp_spawn``'s launcher, returning the trained weights whole: the parent sends rank
    0's ``state_dict()``, whose DTensors the main process (no process group) cannot load."""

    def _collect_rank_zero_results(self, trainer, results: Any) -> _WorkerOutput | None:
        from torch.distributed.tensor import DTensor

        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        # every rank: full_tensor() is a collective
        state_dict = {k: v.full_tensor() if isinstance(v, DTensor) else v
                      for k, v in trainer.lightning_module.state_dict().items()}
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))
