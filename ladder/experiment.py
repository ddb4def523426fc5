"""An experiment file is a small Python module that defines `EXPERIMENT = Experiment(...)`:
the ladder's rungs and the hero they forecast."""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from core.spec import Spec, SpecError
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

    def __post_init__(self):
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
        raise KeyError(f"experiment {self.name!r} has no spec named {name!r}")


def load_experiment(path: str | Path) -> Experiment:
    """Import an experiment file (a path, or a module name such as experiments.proxy_cpu)."""
    p = Path(path)
    if p.suffix == ".py" or p.exists():
        if not p.exists():
            raise SpecError(f"{p}: no such experiment file")
        mod_name = f"_ladder_experiment_{p.stem}"
        spec = importlib.util.spec_from_file_location(mod_name, p)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
        origin = str(p)
    else:
        module = importlib.import_module(str(path))
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


def check_engine(spec: Spec) -> Spec:
    """Engine names are checked where engines are chosen (here and in the CLI), not inside Spec."""
    names = engine_names()
    if spec.engine not in names:
        raise SpecError(f"{spec.name}: unknown engine {spec.engine!r}; registered engines: {', '.join(sorted(names))}")
    return spec
