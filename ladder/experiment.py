"""An experiment file is a small Python module that defines `EXPERIMENT = Experiment(...)`:
the ladder's rungs and the hero they forecast, and optionally the engine options every spec of it
runs under (`options={"torch_ep": "processes", "torch_kernels": {"compile": "none"}}`: core/options.py;
a spec's own options section wins key by key; outside every spec's id)."""

from __future__ import annotations

import importlib.util
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from core.options import Options
from core.spec import Spec, SpecError, check_name, format_validation_error
from engines.registry import engine_names
from engines.tokenizer import check_vocab


@dataclass(frozen=True)
class Experiment:
    name: str
    rungs: tuple[Spec, ...]
    hero: Spec | None = None
    path: str = ""
    notes: str = ""
    extras: tuple[Spec, ...] = field(default=())  # e.g. cooldown branches
    options: Options | dict | None = None  # engine options of every spec (its own section wins)

    def __post_init__(self):
        try:
            check_name(self.name, "experiment name")
        except ValueError as err:
            raise SpecError(str(err)) from None
        if self.options is not None:
            try:
                opts = Options.model_validate(self.options)
            except ValidationError as err:
                raise SpecError(f"experiment {self.name!r}: invalid options: "
                                + format_validation_error(err).replace("; ", "; options.").join(["options.", ""])) from None

            def under(s: Spec | None) -> Spec | None:
                return None if s is None else s.model_copy(update={"options": opts.over(s.options)})

            object.__setattr__(self, "options", opts)
            object.__setattr__(self, "rungs", tuple(under(s) for s in self.rungs))
            object.__setattr__(self, "hero", under(self.hero))
            object.__setattr__(self, "extras", tuple(under(s) for s in self.extras))
        names = [s.name for s in self.all_specs()]
        if len(set(names)) != len(names):
            raise SpecError(f"experiment {self.name!r}: spec names must be unique (got {names})")

    def all_specs(self) -> list[Spec]:
        return [*self.rungs, *([self.hero] if self.hero else []), *self.extras]

    def select(self, only: str | None = None, include_hero: bool = False) -> list[Spec]:
        specs = [*self.rungs, *([self.hero] if (self.hero and include_hero) else [])]
        if only:
            pat = re.compile(only)
            specs = [s for s in self.all_specs() if pat.search(s.name)]
        return specs

    def by_name(self, name: str) -> Spec:
        for s in self.all_specs():
            if s.name == name:
                return s
        raise SpecError(f"experiment {self.name!r} has no spec named {name!r}")


def replicate(spec: Spec, seed: int) -> Spec:
    """The same run at another seed, named <name>-seed<seed>: replicates measure the ladder's own
    noise (analysis.runs.replicates groups runs that differ only in their seed)."""
    return spec.replace(seed=seed, name=f"{spec.name}-seed{seed}")


def load_experiment(path: str | Path) -> Experiment:
    """Import an experiment file (a path, or a module name such as experiments.proxy_cpu)."""
    p = Path(path)
    if p.suffix == ".py" or p.exists():
        if not p.exists():
            raise SpecError(f"{p}: no such experiment file")
        if not p.is_file():
            raise SpecError(f"{p}: is a directory, not an experiment file")
        if p.suffix != ".py":
            raise SpecError(f"{p}: an experiment is a Python file (experiments/*.py); for a spec file use "
                            "`ladder validate` or `ladder plan SPEC.yaml`")
        mod_name = f"_ladder_experiment_{p.stem}"
        spec = importlib.util.spec_from_file_location(mod_name, p)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        origin = str(p)
        _run_experiment_code(lambda: spec.loader.exec_module(module), origin)
    else:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", str(path)):
            raise SpecError(f"{path}: no such experiment file (nor a module name)")
        try:
            module = _run_experiment_code(lambda: importlib.import_module(str(path)), str(path))
        except ModuleNotFoundError as err:
            raise SpecError(f"{path}: no such experiment file or module ({err})") from None
        origin = getattr(module, "__file__", str(path))
    exp = getattr(module, "EXPERIMENT", None)
    if not isinstance(exp, Experiment):
        raise SpecError(f"{origin}: defines no EXPERIMENT = Experiment(...)")
    if not exp.path:
        object.__setattr__(exp, "path", str(origin))
    for spec in exp.all_specs():
        check_engine(spec)
        check_vocab(spec)  # model.vocab_size holds every id of its tokenizer (when the file is here)
    return exp


def _run_experiment_code(run, origin: str):
    """Run an experiment module's code; whatever it raises (or a sys.exit; Ctrl-C aside) becomes one
    SpecError naming the file, with the line of the experiment file where it happened."""
    try:
        return run()
    except SpecError as err:
        raise SpecError(f"{origin}: {err}" if origin not in str(err) else str(err)) from None
    except ValidationError as err:
        raise SpecError(f"{origin}: invalid spec: {format_validation_error(err)}{_where(err, origin)}") from None
    except SyntaxError as err:
        raise SpecError(f"{err.filename or origin}:{err.lineno}: syntax error: {err.msg}") from None
    except ModuleNotFoundError as err:
        if err.name == origin:
            raise
        raise SpecError(f"{origin}: cannot import {err.name!r} ({err}){_where(err, origin)}") from None
    except SystemExit as err:
        raise SpecError(f"{origin}: the experiment file called sys.exit({err.code!r}) while loading") from None
    except KeyboardInterrupt:
        raise  # the user's Ctrl-C, not the file's doing
    except BaseException as err:  # Exception, and BaseException or GeneratorExit raised by the file itself
        raise SpecError(f"{origin}: raised {type(err).__name__}: {err}{_where(err, origin)}") from None


def _where(err: BaseException, origin: str) -> str:
    """" (line N)" of the innermost frame in the experiment file, if it is there."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if Path(f.filename).name == Path(origin).name]
    return f" (line {frames[-1].lineno})" if frames else ""


def check_engine(spec: Spec) -> Spec:
    """Engine names are checked where engines are chosen (here and in the CLI), not inside Spec."""
    names = engine_names()
    if spec.engine not in names:
        raise SpecError(f"{spec.name}: unknown engine {spec.engine!r}; registered engines: {', '.join(sorted(names))}")
    return spec
