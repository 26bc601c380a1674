"""Config: one user-facing configuration, a TOML file and command-line flags away.

A :class:`Config` holds what a run needs besides the model: the mesh (``mesh``,
``mesh_axes``), the planning options of :class:`~autoparallel.PlanOptions` by name
(``mp_policy = "bf16"``, ``cost_model = "h100"``, ``cache = "off"``) and the plain ones as
they are. The planning options' defaults, help and checks are PlanOptions' own: Config reads
each default and the help text from PlanOptions (:func:`_option`) and checks a config by
building its PlanOptions (:meth:`Config.plan_options`).

::

    # run.toml
    mesh = [2, 4]
    mesh_axes = ["dp", "tp"]
    mp_policy = "bf16"
    memory_budget = "60GiB"
    checkpointing = "auto"

    config = autoparallel.Config.from_toml("run.toml")
    model = autoparallel.autoparallelize(model, meta_inputs, **config.autoparallelize_keywords())
    plan = autoparallel.plan(model, meta_inputs, **config.plan_keywords())

The command line (``python -m autoparallel``, ``examples/train.py``) derives its flags from
this dataclass with ``tyro``: ``--mesh 2x4 --mesh-axes dp tp --mp-policy bf16``.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import re
import tomllib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Union, get_args, get_origin

import torch
import tyro
from torch.distributed.fsdp import MixedPrecisionPolicy

from .mesh import MeshSpec, mesh_shape_tuple
from .options import CHECKPOINTING, PARALLELISM, PIPELINE, PlanOptions
from .pipeline_plan import SCHEDULES
from .plan import INPUTS, OUTPUTS
from .solver.ilp import SOLVERS
from .solver.memory import OPTIMIZER_STATES
from .solver.costs import PRESETS, CostModel

MP_POLICIES = {
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "fp16": MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32),
    "fp32": None,
}
"""``mp_policy`` by name: compute in bf16 or fp16 with fp32 master weights and gradients
reduced in fp32 (:mod:`autoparallel.precision`), or ``"fp32"``: no policy (the model's dtypes)."""

OPTIMIZERS = tuple(OPTIMIZER_STATES)

SECTIONS = ("model", "train")
"""TOML tables a config file may hold besides the Config's keys, read by the command line and
``examples/train.py`` (:class:`autoparallel.demo.ModelConfig`, ``TrainConfig``);
:meth:`Config.from_toml` leaves them alone."""

RENAMED = {"mesh_shape": "mesh", "mesh_spec": "mesh", "axes": "mesh_axes", "share_blocks": "share_layers",
           "cache_dir": "cache", "mp": "mp_policy"}
"""Deprecated config keys → their name now (each warns once)."""

_warned: set[str] = set()


class ConfigError(ValueError):
    """A configuration that cannot be used; the message is one line naming the key and value."""


def warn_renamed(old: str, new: str, where: str = "config") -> None:
    """A DeprecationWarning, once per process and ``old`` name."""
    if old not in _warned:
        _warned.add(old)
        warnings.warn(f"{where}: {old!r} is deprecated; use {new!r}", DeprecationWarning, stacklevel=3)


def _doc(cls, name: str) -> str:
    """The text of ``name`` in the ``Attributes:`` section of ``cls``'s docstring, on one line,
    with Sphinx roles reduced to their last name (``:func:`~a.b``` → ``b``)."""
    text, found, lines = inspect.getdoc(cls) or "", False, []
    section = text.split("Attributes:", 1)[-1]
    for line in section.splitlines():
        m = re.match(r"^    (\w+): (.*)$", line)
        if m:
            if found:
                break
            found = m.group(1) == name
            if found:
                lines.append(m.group(2))
        elif found and line.startswith("        "):
            lines.append(line.strip())
        elif found:
            break
    out = " ".join(lines)
    out = re.sub(r":\w+:`~?([^`]*)`", lambda m: m.group(1).split(".")[-1], out)
    return re.sub(r'``"?([^`"]*)"?``', r"\1", out)


def _option(name: str):
    """The default of PlanOptions' option ``name`` (a Config field's default)."""
    return {f.name: f for f in dataclasses.fields(PlanOptions)}[name].default


def _arg(name: str):
    """The command-line help of PlanOptions' option ``name``: its docstring's text."""
    return tyro.conf.arg(help=_doc(PlanOptions, name))


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"2x4"`` (or ``"2,4"``, ``"8"``) as ``(2, 4)``.

    Raises:
        ConfigError: not positive integers separated by ``x``.
    """
    parts = re.split(r"[x,]", str(text).strip().lower())
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(f"mesh {text!r}: expected devices per axis as positive integers, e.g. 2x4 or 8")
    return tuple(int(p) for p in parts)


_MESH_ARG = tyro.constructors.PrimitiveConstructorSpec(
    nargs=1, metavar="AxB", instance_from_str=lambda args: parse_mesh(args[0]),
    is_instance=lambda v: isinstance(v, tuple), str_from_instance=lambda v: ["x".join(map(str, v))])

Mesh = Annotated[tuple[int, ...], _MESH_ARG]


@dataclass(frozen=True)
class Config:
    """A run's configuration (see the module docstring). Each field's flag is its name with
    dashes (``--memory-budget``); each TOML key its name.

    Raises (on construction):
        ConfigError: a bad value (one line naming the key), including every check of
            :class:`~autoparallel.PlanOptions`.
    """

    mesh: Mesh = (2, 2)
    """devices per mesh axis, e.g. 2x4 (TOML: [2, 4]); their product is the number of processes"""
    mesh_axes: tuple[str, ...] | None = None
    """one name per mesh axis, e.g. dp tp (TOML: ["dp", "tp"]); default dim0, dim1, ..."""
    mp_policy: Literal[tuple(MP_POLICIES)] = "fp32"
    """mixed precision: compute in bf16 or fp16 (fp32 master weights, gradients reduced in fp32),
    or fp32: no policy, the model's own dtypes"""
    memory_budget: Annotated[Union[int, float, str, None], _arg("memory_budget")] = _option("memory_budget")
    checkpointing: Annotated[Literal[CHECKPOINTING], _arg("checkpointing")] = _option("checkpointing")
    offload: Annotated[bool, _arg("offload")] = _option("offload")
    zero: Annotated[bool, _arg("zero")] = _option("zero")
    pipeline: Annotated[Literal[PIPELINE], _arg("pipeline")] = _option("pipeline")
    microbatches: Annotated[Union[int, None], _arg("microbatches")] = _option("microbatches")
    schedule: Annotated[Union[Literal[SCHEDULES], None], _arg("schedule")] = _option("schedule")
    outputs: Annotated[Literal[OUTPUTS], _arg("outputs")] = _option("outputs")
    inputs: Annotated[Literal[INPUTS], _arg("inputs")] = _option("inputs")
    cost_model: str = "auto"
    """the cost model: a device preset (a100, h100, cpu), or auto: plan/compare price with the a100
    preset, autoparallelize measures the mesh it runs on (profile_mesh, cached)"""
    cache: str = "auto"
    """plan cache: auto ($AUTOPARALLEL_CACHE_DIR or ~/.cache/autoparallel), off, or a folder"""
    optimizer: Annotated[Literal[OPTIMIZERS], _arg("optimizer")] = _option("optimizer")
    optimizer_foreach: Annotated[Union[bool, None], _arg("optimizer_foreach")] = _option("optimizer_foreach")
    solver: Annotated[Literal[SOLVERS], _arg("solver")] = _option("solver")
    time_limit: Annotated[float, _arg("time_limit")] = _option("time_limit")
    parallelism: Annotated[Literal[PARALLELISM], _arg("parallelism")] = _option("parallelism")
    strict: Annotated[bool, _arg("strict")] = _option("strict")
    share_layers: Annotated[bool, _arg("share_layers")] = _option("share_layers")
    stamp_layers: Annotated[bool, _arg("stamp_layers")] = _option("stamp_layers")

    def __post_init__(self):
        try:
            object.__setattr__(self, "mesh", mesh_shape_tuple(self.mesh, "mesh"))
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None
        if self.mesh_axes is not None:
            axes = tuple(self.mesh_axes) if not isinstance(self.mesh_axes, str) else None
            if axes is None or not all(isinstance(a, str) and a for a in axes) or len(set(axes)) != len(axes):
                raise ConfigError(f"mesh_axes must be distinct names, one per mesh axis, not {self.mesh_axes!r}")
            if len(axes) != len(self.mesh):
                raise ConfigError(f"mesh_axes {list(axes)} names {len(axes)} axes but mesh {self.mesh_text()} "
                                  f"has {len(self.mesh)}")
            object.__setattr__(self, "mesh_axes", axes)
        if self.mp_policy not in MP_POLICIES:
            raise ConfigError(f"mp_policy must be one of {', '.join(map(repr, MP_POLICIES))}, not {self.mp_policy!r}")
        if self.cost_model != "auto" and self.cost_model not in PRESETS:
            raise ConfigError(f"cost_model must be 'auto' or a device preset ({', '.join(map(repr, sorted(PRESETS)))}), "
                              f"not {self.cost_model!r}")
        if not isinstance(self.cache, str) or not self.cache:
            raise ConfigError(f"cache must be 'auto', 'off' or a folder, not {self.cache!r}")
        self.plan_options()  # every check of PlanOptions, as a ConfigError

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_dict(cls, data: dict, where: str = "config") -> "Config":
        """A Config from ``data`` (TOML-like values: lists for tuples).

        Raises:
            ConfigError: an unknown key (naming the closest ones), a value of the wrong type,
                a deprecated key given with its new name, or a bad value.
        """
        return cls(**check_keys(cls, data, where, renamed=RENAMED))

    @classmethod
    def from_toml(cls, path, **overrides) -> "Config":
        """The Config of a TOML file's top-level keys (its ``[model]`` and ``[train]`` tables,
        :data:`SECTIONS`, are left to the CLI and training script), with ``overrides`` replacing
        keys.

        Raises:
            ConfigError: an unreadable file or TOML, or as :meth:`from_dict`.
        """
        data = {k: v for k, v in read_toml(path).items() if k not in SECTIONS}
        return cls.from_dict({**data, **overrides}, where=str(path))

    def replace(self, **changes) -> "Config":
        """A copy with ``changes`` (checked as :meth:`from_dict` does)."""
        return dataclasses.replace(self, **check_keys(type(self), changes, "config", renamed=RENAMED))

    # ------------------------------------------------------------------ what the API takes
    def mesh_text(self) -> str:
        return "x".join(map(str, self.mesh))

    def axis_names(self) -> tuple[str, ...]:
        """``mesh_axes``, or :class:`MeshSpec`'s default names."""
        return self.mesh_axes or MeshSpec(self.mesh).axis_names

    def mesh_spec(self) -> MeshSpec:
        """The :class:`MeshSpec` of ``mesh`` and ``mesh_axes`` (default link costs)."""
        return MeshSpec(self.mesh, self.axis_names())

    def device_mesh(self, device_type: str | None = None):
        """``init_device_mesh(device_type, mesh, mesh_dim_names=axis names)`` (default device: cuda
        when available, else cpu); needs an initialized process group of ``prod(mesh)`` ranks.

        Raises:
            ConfigError: the world size is not the mesh's number of devices.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if dist.is_initialized() and dist.get_world_size() != math.prod(self.mesh):
            raise ConfigError(f"mesh {self.mesh_text()} has {math.prod(self.mesh)} devices but the world has "
                              f"{dist.get_world_size()} processes; run with --nproc-per-node {math.prod(self.mesh)} "
                              f"or set --mesh")
        device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        return init_device_mesh(device_type, self.mesh, mesh_dim_names=self.axis_names())

    def plan_options(self, **keywords) -> PlanOptions:
        """The :class:`~autoparallel.PlanOptions` of this config, ``keywords`` replacing fields.

        Raises:
            ConfigError: a value PlanOptions refuses (its message, one line).
        """
        shared = {f.name for f in dataclasses.fields(PlanOptions)} & {f.name for f in dataclasses.fields(self)}
        values = {k: getattr(self, k) for k in shared if k != "mp_policy"}
        values.update(mp_policy=MP_POLICIES[self.mp_policy],
                      cost_model=None if self.cost_model == "auto" else CostModel(self.cost_model),
                      cache_dir={"auto": None, "off": False}.get(self.cache, self.cache))
        values.update(keywords)
        try:
            return PlanOptions(**values)
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None

    def plan_keywords(self, **keywords) -> dict:
        """Keywords of :func:`autoparallel.plan` and :func:`autoparallel.compare`:
        ``mesh_spec`` and ``options``."""
        return {"mesh_spec": self.mesh_spec(), "options": self.plan_options(**keywords)}

    def autoparallelize_keywords(self, device_type: str | None = None, **keywords) -> dict:
        """Keywords of :func:`autoparallel.autoparallelize`: ``device_mesh``
        (:meth:`device_mesh`) and ``options``."""
        return {"device_mesh": self.device_mesh(device_type), "options": self.plan_options(**keywords)}


# ---------------------------------------------------------------------- shared by TOML readers
def read_toml(path) -> dict:
    """The TOML file at ``path`` as a dict.

    Raises:
        ConfigError: a missing or unreadable file, or invalid TOML (with the line)."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def check_keys(cls, data: dict, where: str, renamed: dict | None = None) -> dict:
    """``data`` checked against the dataclass ``cls``'s fields: deprecated keys renamed (warning
    once), unknown keys refused naming the closest ones, lists turned into tuples, and each
    value's type checked against the field's annotation.

    Raises:
        ConfigError: as :meth:`Config.from_dict`.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a table of keys, not {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = _hints(cls)
    out = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if renamed and name in renamed and name not in fields:
            new = renamed[name]
            warn_renamed(key, new, where)
            if new in data or new in out:
                raise ConfigError(f"{where}: give {new!r} only ({key!r} is its deprecated name)")
            name = new
        if name not in fields:
            close = difflib.get_close_matches(name, sorted(fields), n=3)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else \
                f"; keys are {', '.join(sorted(fields))}"
            raise ConfigError(f"{where}: unknown key {key!r}{hint}")
        if name == "mesh" and isinstance(value, str):
            value = parse_mesh(value)
        if isinstance(value, list):
            value = tuple(value)
        if not _fits(value, hints[name]):
            raise ConfigError(f"{where}: {name} must be {_describe(hints[name])}, not {value!r}")
        out[name] = value
    return out


def _hints(cls) -> dict:
    import typing

    return typing.get_type_hints(cls, include_extras=False)


def _fits(value, hint) -> bool:
    origin, args = get_origin(hint), get_args(hint)
    if hint is type(None):
        return value is None
    if origin is Literal:
        return value in args
    if origin in (Union, __import__("types").UnionType):
        return any(_fits(value, a) for a in args)
    if origin is tuple:
        return isinstance(value, tuple) and all(_fits(v, args[0]) for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _describe(hint) -> str:
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (Union, __import__("types").UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is tuple:
        return f"a list of {_describe(args[0])}s"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            type(None): "absent"}.get(hint, str(hint))
