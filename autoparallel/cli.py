"""Command line: ``python -m autoparallel {plan,compare,report,coverage,train} ...``.

The flags are derived (with ``tyro``) from the dataclasses that hold them:
:class:`~autoparallel.config.Config` (mesh, mixed precision, memory budget, checkpointing and
the planning options), :class:`~autoparallel.demo.ModelConfig` (the demo model: ``--model
gpt2|llama|bert`` built from a Hugging Face config with random weights, or ``--factory
package.module:function`` returning ``(model, meta_inputs)``) and for ``train``
:class:`~autoparallel.demo.TrainConfig`. Each flag has help and a default
(``python -m autoparallel plan --help``). ``--config run.toml`` reads a config file (its
top-level keys the Config, its ``[model]`` and ``[train]`` tables the others); flags given
too override it.

Examples::

    python -m autoparallel plan --model llama --layers 32 --hidden 4096 --heads 32 --mesh 8x8 \\
        --batch 64 --seq 2048
    python -m autoparallel plan --model gpt2 --mesh 2x2 --mesh-axes dp tp \\
        --constraint 'lm_head.weight=S0(tp)' --report out/
    python -m autoparallel compare --model llama --layers 4 --mesh 2x4
    python -m autoparallel report out/ --config run.toml
    python -m autoparallel coverage --model bert
    python -m autoparallel train --model gpt2 --layers 2 --hidden 64 --mesh 2 --steps 20

``plan`` prints the plan's summary (``--table``: the per-module table; ``--compare``: also the
plan beside DDP, FSDP, Megatron TP and FSDP + TP, :func:`autoparallel.compare`; ``--report
DIR``: writes ``summary.txt``, ``table.txt``, ``plan.json`` and ``plan.png`` into ``DIR``).
``compare`` is ``plan --compare``; ``report DIR`` is ``plan --report DIR``. ``train`` runs
``examples/train.py`` (AdamW, warm-up and cosine schedule, clipping, checkpoints) under
``torchrun`` on ``prod(mesh)`` local gloo (CPU) or NCCL (GPU) processes.

A bad value prints one line (``python -m autoparallel plan: error: ...``) and exits with 2,
before any tracing or planning; so does an output file or folder that cannot be written.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Union

import tyro

from .config import Config, ConfigError, read_toml, warn_renamed
from .demo import ModelConfig, TrainConfig

PROG = "python -m autoparallel"
DEPRECATED_FLAGS = {"--axes": "--mesh-axes", "--device": "--cost-model"}
"""Old flags → their name now (each warns once; ``--axes dp,tp`` becomes ``--mesh-axes dp tp``)."""
TRAIN_SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "train.py"

_Flat = tyro.conf.OmitArgPrefixes


@dataclass(frozen=True)
class _Common:
    run: Annotated[Config, _Flat, tyro.conf.arg(help="mesh, precision, memory, checkpointing and planning options "
                                                     "(autoparallel.Config; TOML: top-level keys)")]
    model_config: Annotated[ModelConfig, _Flat, tyro.conf.arg(help="the demo model and its batch (TOML: [model])")]
    config_file: Annotated[str | None, tyro.conf.arg(name="config", metavar="FILE.toml")] = None
    """config file (TOML): its keys set the defaults; flags given too override them"""
    verbose: Annotated[bool, tyro.conf.arg(aliases=("-v",))] = False
    """log progress per stage, and show the traceback of an unexpected error"""


@dataclass(frozen=True)
class PlanCmd(_Common):
    """Solve the sharding plan and print its summary."""

    constraint: Annotated[tuple[str, ...], tyro.conf.UseAppendAction, tyro.conf.arg(metavar="PATTERN=PLACEMENTS")] = ()
    """pin tensors matching PATTERN, e.g. 'lm_head.weight=S0(tp)'"""
    compare: bool = False
    """also plan DDP, FSDP, Megatron TP and FSDP + TP under the same cost model and print them"""
    table: bool = False
    """print the per-node table, not the summary"""
    report: Annotated[str | None, tyro.conf.arg(metavar="DIR")] = None
    """write summary.txt, table.txt, plan.json and plan.png into DIR"""
    json: Annotated[str | None, tyro.conf.arg(metavar="FILE")] = None
    """also write the plan as JSON to FILE"""


@dataclass(frozen=True)
class CompareCmd(_Common):
    """Plan the model and every hand-written recipe (DDP, FSDP, Megatron TP, FSDP + TP) on one capture."""

    json: Annotated[str | None, tyro.conf.arg(metavar="FILE")] = None
    """also write the plan as JSON to FILE"""


@dataclass(frozen=True)
class ReportCmd(_Common):
    """Plan the model and write summary.txt, table.txt, plan.json and plan.png into a folder."""

    out: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="DIR")] = "autoparallel-report"
    """the folder (created)"""
    constraint: Annotated[tuple[str, ...], tyro.conf.UseAppendAction, tyro.conf.arg(metavar="PATTERN=PLACEMENTS")] = ()
    """pin tensors matching PATTERN, e.g. 'lm_head.weight=S0(tp)'"""


@dataclass(frozen=True)
class CoverageCmd(_Common):
    """List the model's ATen ops and where their sharding strategies come from."""

    json: Annotated[str | None, tyro.conf.arg(metavar="FILE")] = None
    """also write the report as JSON to FILE"""


@dataclass(frozen=True)
class TrainCmd(_Common):
    """Train the demo model a few steps: examples/train.py under torchrun on prod(mesh) local processes."""

    train: Annotated[TrainConfig, _Flat, tyro.conf.arg(help="the training recipe (TOML: [train])")] = TrainConfig()


COMMANDS = {"plan": PlanCmd, "compare": CompareCmd, "report": ReportCmd, "coverage": CoverageCmd, "train": TrainCmd}


def parse(argv: list[str], commands=None, prog: str = PROG):
    """The command object of ``argv`` (``--config FILE`` read first, its values the defaults).

    Raises:
        SystemExit: ``--help`` (0), or a bad flag or value (2, after one line on stderr).
    """
    argv = _renamed_flags(list(argv))
    commands = commands or COMMANDS
    path = _config_path(argv)
    run, model, train = Config(), ModelConfig(), TrainConfig()
    if path is not None:
        try:
            data = read_toml(path)
            run = Config.from_toml(path)
            model = ModelConfig.from_toml(path) if "model" in data else model
            train = TrainConfig.from_toml(path) if "train" in data else train
        except ConfigError as e:
            _fail(prog, str(e))
    defaults = {}
    for name, cls in commands.items():
        kw = dict(run=run, model_config=model)
        if cls is TrainCmd:
            kw["train"] = train
        defaults[name] = cls(**kw)
    if len(commands) == 1:
        (name, cls), = commands.items()
        spec, label = cls, prog
        kwargs = dict(default=defaults[name])
    else:
        spec = Union[tuple(Annotated[cls, tyro.conf.subcommand(name, default=defaults[name],
                                                                 description=cls.__doc__)]
                           for name, cls in commands.items())]
        label, kwargs = prog, {}
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            result = tyro.cli(spec, args=argv, prog=label, description=__doc__.split("\n\n")[0],
                            config=(tyro.conf.OmitSubcommandPrefixes,), **kwargs)
    except SystemExit as e:
        if e.code:
            _fail(prog, _one_line(err.getvalue()) or "bad arguments (see --help)")
        raise
    except ConfigError as e:  # a dataclass's own check, on construction
        _fail(prog, str(e))
    sys.stderr.write(err.getvalue())  # warnings printed while parsing
    return result


def main(argv=None) -> int:
    """Run one command; returns the exit status (0 done, 1 planning failed, 2 bad arguments)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cmd = parse(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    name = next(k for k, v in COMMANDS.items() if isinstance(cmd, v))
    where = f"{PROG} {name}"
    if cmd.verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        if isinstance(cmd, TrainCmd):
            return _train(cmd, argv)
        _check_writable(cmd)
        constraints = _constraints(cmd)
        model, meta_inputs = cmd.model_config.build("meta")
        _run(cmd, model, meta_inputs, constraints)
    except ConfigError as e:
        print(f"{where}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001: one line, not a traceback (-v shows it)
        if cmd.verbose:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"{where}: error: {type(e).__name__}: {first}", file=sys.stderr)
        return 1
    return 0


def _run(cmd, model, meta_inputs, constraints) -> None:
    import autoparallel

    if isinstance(cmd, CoverageCmd):
        result = autoparallel.coverage(model, meta_inputs, stamp_layers=cmd.run.stamp_layers)
        print(result)
        _write_json(cmd.json, result)
        return
    keywords = cmd.run.plan_keywords()
    compare = isinstance(cmd, CompareCmd) or getattr(cmd, "compare", False)
    if compare:
        if constraints:
            raise ConfigError("--compare prices the unconstrained plan: drop --constraint")
        comparison = autoparallel.compare(model, meta_inputs, **keywords)
        result = comparison.plan
    else:
        result = autoparallel.plan(model, meta_inputs, constraints=constraints or None, **keywords)
    print(result.table() if getattr(cmd, "table", False) else result)
    if compare:
        print(comparison)
    folder = cmd.out if isinstance(cmd, ReportCmd) else getattr(cmd, "report", None)
    if folder:
        for path in write_report(result, folder):
            print(f"wrote {path}")
    _write_json(getattr(cmd, "json", None), result)


def _write_json(path, result) -> None:
    if path:
        Path(path).write_text(result.to_json())


def _constraints(cmd) -> dict:
    """``--constraint PATTERN=PLACEMENTS`` as a dict, each placement text parsed against the
    mesh's axis names (before tracing: a typo fails in a second, not after the capture).

    Raises:
        ConfigError: no ``=``, or placement text that does not parse (the constraint's message)."""
    from .constraints import ConstraintError, as_spec

    out = {}
    for item in getattr(cmd, "constraint", ()):
        pattern, sep, placements = item.partition("=")
        if not sep or not pattern or not placements:
            raise ConfigError(f"--constraint {item!r}: expected PATTERN=PLACEMENTS, e.g. 'lm_head.weight=S0(tp)'")
        try:
            as_spec(placements, cmd.run.mesh_spec(), pattern)
        except ConstraintError as e:
            raise ConfigError(str(e)) from None
        out[pattern] = placements
    return out


def _check_writable(cmd) -> None:
    """Output files and folders checked before planning.

    Raises:
        ConfigError: a ``--json`` file or a report folder that cannot be created or written."""
    json_path = getattr(cmd, "json", None)
    if json_path:
        p = Path(json_path)
        if p.is_dir():
            raise ConfigError(f"--json {json_path}: is a folder; give a file name")
        parent = p.parent if str(p.parent) else Path(".")
        if not parent.is_dir():
            raise ConfigError(f"--json {json_path}: folder {parent} does not exist")
        if not os.access(p if p.exists() else parent, os.W_OK):
            raise ConfigError(f"--json {json_path}: not writable")
    folder = cmd.out if isinstance(cmd, ReportCmd) else getattr(cmd, "report", None)
    if folder:
        p = Path(folder)
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"report folder {folder}: cannot create it ({e.strerror or e})") from None
        if not os.access(p, os.W_OK):
            raise ConfigError(f"report folder {folder}: not writable")


def _train(cmd: TrainCmd, argv: list[str]) -> int:
    """``examples/train.py`` under ``torchrun --standalone --nproc-per-node prod(mesh)``, with the
    flags after ``train``; returns its exit status."""
    if not TRAIN_SCRIPT.exists():
        raise ConfigError(f"train runs {TRAIN_SCRIPT}, which is not there (an installed package has no "
                          "examples/): run it from a checkout of the repository")
    rest = list(argv[argv.index("train") + 1:])
    n = math.prod(cmd.run.mesh)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
               str(TRAIN_SCRIPT), *_renamed_flags(rest, warn=False)]
    print(" ".join(command), flush=True)
    root = str(TRAIN_SCRIPT.parent.parent)  # the processes import this checkout's autoparallel
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    return subprocess.call(command, env=env)


def write_report(plan, folder) -> list[str]:
    """Write ``summary.txt``, ``table.txt``, ``plan.json`` and ``plan.png`` of ``plan`` into
    ``folder`` (created); returns the paths written.

    Raises:
        ImportError: matplotlib is missing (the ``plot`` extra), after the text files.
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in (("summary.txt", str(plan)), ("table.txt", plan.table()), ("plan.json", plan.to_json())):
        (out / name).write_text(text + ("\n" if not text.endswith("\n") else ""))
        written.append(str(out / name))
    return written + plan.plot(out / "plan.png")


# ---------------------------------------------------------------------- argv helpers
def _config_path(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return None


def _renamed_flags(argv: list[str], warn: bool = True) -> list[str]:
    """``argv`` with the deprecated flags of :data:`DEPRECATED_FLAGS` renamed (warning once each)."""
    out = []
    i = 0
    while i < len(argv):
        a = argv[i]
        flag, eq, value = a.partition("=")
        if flag in DEPRECATED_FLAGS:
            if warn:
                warn_renamed(flag, DEPRECATED_FLAGS[flag], PROG)
            if not eq:
                i += 1
                value = argv[i] if i < len(argv) else ""
            out.append(DEPRECATED_FLAGS[flag])
            out.extend(value.split(",") if flag == "--axes" else [value])
        else:
            out.append(a)
        i += 1
    return out


def _one_line(text: str) -> str:
    """tyro's boxed error message as one line: the box's first paragraph (under its title line,
    above its first rule), borders removed (UTF-8 or plain boxes alike)."""
    rows = [line for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines() if line.strip()]
    lines = []
    for line in rows[1:]:
        line = line.strip().strip("│|+").strip()
        if line and set(line) <= set("─-═╰╯+ "):
            if lines:
                break  # the rule under the message (or the box's bottom): the rest is help
            continue  # a plain box's rule under its title
        lines.append(line)
    text = " ".join(lines).replace("Error parsing ", "")
    return re.sub(r"^\S*__tyro\S*: ", "", text)  # tyro's name of the struct whose check raised


def _fail(prog: str, message: str):
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    sys.exit(main())
