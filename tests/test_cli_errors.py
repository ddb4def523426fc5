"""Every command, fed bad input through the real CLI in a process of its own, prints one line and
exits 2: never a traceback, never a partial write. A small ladder (three trained rungs, a hero
stopped half-way and its forecast) is the ground the bad inputs stand on. The many-case tests fork
their CLI processes from one driver that imported the CLI once (tests/cli_fork.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import cli_fork
from tests.cli_fork import ladder_many
from tests.support import tiny_changes

ROOT = Path(__file__).resolve().parents[1]
STEPS = 20
RUNGS = [("r16", {"model.d_model": 16}), ("r24", {"model.d_model": 24}), ("r32", {"model.d_model": 32})]
HERO = ("h40", {"model.d_model": 40})


def ladder(*args, cwd: Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return cli_fork.ladder(*args, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                                                **(env or {})}, timeout=timeout)


# what the commands below import lazily, imported once by the driver that forks their processes
PRELOAD = ("analysis.forecast", "analysis.report", "ladder.controller", "ladder.tracking", "engines.torch.engine")


def ladder_each(argvs: list[list], cwd: Path) -> list[subprocess.CompletedProcess]:
    """`python -m ladder.cli ARGV` in cwd for each argv, each a process of its own (forked, three at a time)."""
    return ladder_many([(a, cwd) for a in argvs], env={"OMP_NUM_THREADS": "1"}, preload=PRELOAD)


def experiment_source(name: str, rungs, hero, extra: str = "") -> str:
    base = tiny_changes(STEPS, 10)
    return textwrap.dedent(f"""
        from ladder.experiment import Experiment
        from ladder.presets import micro_spec
        {extra}
        BASE = {base!r}
        EXPERIMENT = Experiment(
            name={name!r},
            rungs=tuple(micro_spec(n, **{{**BASE, **c}}) for n, c in {rungs!r}),
            hero={"None" if hero is None else f"micro_spec({hero[0]!r}, **{{**BASE, **{hero[1]!r}, 'role': 'hero'}})"},
        )
        """)


def snapshot(d: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(d.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """cwd with exp.py, the ladder root .ladder (three finished rungs, the hero stopped at step 10 of
    20, forecast.json), spec files and CSVs."""
    from engines.registry import get_engine
    from ladder import ledger
    from ladder.experiment import load_experiment

    w = tmp_path_factory.mktemp("world")
    (w / "exp.py").write_text(experiment_source("errs", RUNGS, HERO))
    exp = load_experiment(w / "exp.py")
    root = w / ".ladder"
    for spec in exp.all_specs():
        d = ledger.run_dir_for(root, exp.name, spec)
        ledger.write_spec_file(d, spec)
        for m in get_engine(spec.engine).train(spec, d, resume=True):
            if spec.role == "hero" and m.step + 1 >= STEPS // 2:
                break
    fc = ladder("forecast", "exp.py", "--no-tracking", cwd=w)
    assert fc.returncode == 0, fc.stderr
    (w / "good.yaml").write_text(exp.rungs[0].to_yaml())
    (w / "runs.csv").write_text("N,D,loss\n1e6,2e7,3.9\n2e6,4e7,3.6\n4e6,8e7,3.4\n8e6,1.6e8,3.25\n1.6e7,3.2e8,3.1\n")
    (w / "adir").mkdir()
    (w / "afile").write_text("not a directory\n")
    return w


def spec_yaml(w: Path, file: str, **changes) -> Path:
    from ladder.presets import micro_spec

    doc = micro_spec("bad").model_dump(mode="json")
    for dotted, value in changes.items():
        node = doc
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    import yaml

    path = w / f"{file}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def bad_experiment(w: Path, name: str, source: str) -> Path:
    path = w / f"{name}.py"
    path.write_text(source)
    return path


def _cases(w: Path) -> list[tuple[str, list, str]]:
    """(label, argv, a phrase the one error line must hold)."""
    hero_dir = next((w / ".ladder" / "runs" / "errs").glob("h40-*"))
    (w / "fc_list.json").write_text("[1, 2, 3]\n")
    (w / "big.py").write_text(experiment_source("big", [("huge", {"model.d_model": 8192, "model.n_heads": 64,
                                                                  "model.n_layers": 64, "model.n_routed_experts": 512,
                                                                  "model.expert_hidden": 16384, "model.latent_dim": 4096,
                                                                  "hardware.hbm_gb": 1.0})], None))
    experiments = {
        "raises": bad_experiment(w, "e_raises", "raise RuntimeError('boom')\n"),
        "syntax": bad_experiment(w, "e_syntax", "def f(:\n"),
        "import": bad_experiment(w, "e_import", "import no_such_module_here\n"),
        "exit0": bad_experiment(w, "e_exit", "import sys\nsys.exit(0)\n"),
        "escape": bad_experiment(w, "e_escape", experiment_source("../../escape", RUNGS[:1], None)),
        "spec-escape": bad_experiment(w, "e_spec_escape", experiment_source("ok", [("../../x", {})], None)),
        "no-experiment": bad_experiment(w, "e_empty", "X = 1\n"),
    }
    specs = {
        "escape": spec_yaml(w, "s_escape", name="../../escape"),
        "inf-lr": spec_yaml(w, "s_lr", **{"optim.peak_lr": float("inf")}),
        "inf-std": spec_yaml(w, "s_std", **{"model.init_std": float("inf")}),
        "inf-flops": spec_yaml(w, "s_flops", **{"hardware.peak_flops": float("inf")}),
        "bool-layers": spec_yaml(w, "s_bool", **{"model.n_layers": True}),
        "too-big": spec_yaml(w, "s_big", **{"hardware.hbm_gb": 1e-6}),
    }
    (w / "s_bytes.yaml").write_bytes(b"name: \xff\xfe\n")
    (w / "s_list.yaml").write_text("- 1\n- 2\n")
    out = []
    for label, f in experiments.items():
        phrase = {"raises": "boom", "syntax": "syntax error", "import": "no_such_module_here", "exit0": "sys.exit(0)",
                  "escape": "not a safe name", "spec-escape": "not a safe name", "no-experiment": "no EXPERIMENT"}[label]
        for cmd in ("plan", "submit", "forecast", "report", "status"):
            extra = ["--no-tracking"] if cmd in ("submit", "forecast", "report") else []
            if cmd == "report":
                extra += ["--out", w / "never_written"]
            out.append((f"{cmd} experiment {label}", [cmd, f, *extra], phrase))
    for label, f in specs.items():
        phrase = {"escape": "not a safe name", "inf-lr": "optim.peak_lr", "inf-std": "model.init_std",
                  "inf-flops": "hardware.peak_flops", "bool-layers": "model.n_layers", "too-big": "GB per device"}[label]
        if label != "too-big":
            out.append((f"validate spec {label}", ["validate", f], phrase))
        out.append((f"train spec {label}", ["train", f, "--run-dir", w / "never_run"], phrase))
    out += [
        ("validate a directory", ["validate", w / "adir"], "is a directory"),
        ("validate non-UTF-8 bytes", ["validate", w / "s_bytes.yaml"], "cannot read"),
        ("validate a YAML list", ["validate", w / "s_list.yaml"], "must be a mapping"),
        ("validate a missing file", ["validate", w / "nope.yaml"], "no such spec file"),
        ("train a directory as the spec", ["train", w / "adir", "--run-dir", w / "never_run"], "is a directory"),
        ("train --run-dir at a file", ["train", w / "good.yaml", "--run-dir", w / "afile"], "is a file"),
        ("submit --retries -5", ["submit", "exp.py", "--retries", "-5", "--no-tracking"], "--retries"),
        ("submit a spec too big for its memory", ["submit", "big.py", "--no-tracking"], "GB per device"),
        ("status --root at a file", ["status", "--root", w / "afile"], "is a file"),
        ("sync --root at a file", ["sync", "--root", w / "afile"], "is a file"),
        ("forecast --root at a file", ["forecast", "exp.py", "--root", w / "afile", "--no-tracking"], "is a file"),
        ("report --out at a file", ["report", "exp.py", "--out", w / "afile", "--no-tracking"], "afile"),
        ("report a forecast that is a list", ["report", "exp.py", "--out", w / "never_written", "--no-tracking",
                                              "--root", w / "root_list"], "not a forecast (a JSON object is expected)"),
        ("compare a forecast that is a list", ["compare", hero_dir, "--forecast", w / "fc_list.json"], "not a forecast"),
        ("calibrate --root at a file", ["calibrate", "exp.py", "--root", w / "afile"], "is a file"),
        ("calibrate against a forecast that is a list", ["calibrate", "exp.py", "--forecast", w / "fc_list.json"],
         "not a forecast"),
        ("calibrate without replicates of the hero", ["calibrate", "exp.py"], "at least 2 finished runs"),
        ("compare a missing run", ["compare", w / "adir"], "metrics.jsonl"),
        ("replan --days inf", ["replan", hero_dir, "--spec", hero_dir / "spec.yaml", "--days", "inf",
                               "--out", w / "never_written"], "--days"),
        ("replan --apply 99", ["replan", hero_dir, "--spec", hero_dir / "spec.yaml", "--days", "1", "--apply", "99",
                               "--out", w / "never_written"], "--apply 99"),
        ("replan --out at a file", ["replan", hero_dir, "--spec", hero_dir / "spec.yaml", "--days", "1",
                                    "--out", w / "afile"], "afile"),
        ("law fit on a missing column", ["law", "fit", w / "runs.csv", "--params-col", "P", "--tokens-col", "D",
                                         "--loss-col", "loss"], "missing column"),
        ("law fit on a directory", ["law", "fit", w / "adir", "--params-col", "N", "--tokens-col", "D",
                                    "--loss-col", "loss"], "is a directory"),
        ("curve fit on a missing file", ["curve", "fit", "--train", w / "nope.csv", "--predict", w / "nope.csv",
                                         "--out", w / "never_written"], "nope.csv"),
    ]
    return out


def _root_with_list_forecast(w: Path) -> None:
    """A copy of the ladder root whose forecast.json is a JSON list."""
    dst = w / "root_list"
    shutil.copytree(w / ".ladder", dst)
    (dst / "analysis" / "errs" / "forecast.json").write_text("[1, 2]\n")


@pytest.mark.slow
def test_every_command_answers_bad_input_with_one_line_and_exit_2_writing_nothing(world):
    _root_with_list_forecast(world)
    cases = _cases(world)
    before = snapshot(world)
    results = ladder_each([argv for _, argv, _ in cases], world)
    problems = []
    for (label, argv, phrase), r in zip(cases, results):
        lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]
        ok = r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and phrase in lines[0]
        if not ok or "Traceback" in r.stderr:
            problems.append(f"{label}: exit {r.returncode}, stderr {r.stderr.strip()[-600:]!r}")
    assert not problems, "\n".join(problems)
    after = snapshot(world)
    created = sorted(set(after) - set(before))
    changed = sorted(k for k in before if k in after and after[k] != before[k])
    assert not created and not changed, (created, changed)
    assert not (world / "never_written").exists() and not (world / "never_run").exists()
    assert not (world.parent / "escape").exists() and not (world / ".ladder" / "escape").exists()


@pytest.mark.slow
def test_an_unreachable_ray_address_fails_within_the_timeout_with_one_line(world):
    # the wait is 3 s; the subprocess timeout only catches a submission that waits forever
    r = ladder("submit", "exp.py", "--include-hero", "--address", "127.0.0.1:1", "--no-tracking", cwd=world,
               env={"MOE_LADDER_LIMITS": "ray_timeout_s=3"})
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "cannot reach Ray at 127.0.0.1:1 within 3 s" in lines[0], r.stderr


@pytest.mark.slow
def test_report_on_an_unfinished_hero_gives_its_step_and_the_forecast_there(world, tmp_path):
    r = ladder("report", "exp.py", "--out", tmp_path / "rep", "--no-tracking", cwd=world)
    assert r.returncode == 0, r.stderr
    verdict = json.loads((tmp_path / "rep" / "summary.json").read_text())["verdict"]
    assert verdict.startswith(f"Hero at step {STEPS // 2} of {STEPS}: not finished"), verdict
    assert "final eval loss" not in verdict and "vs forecast" in verdict and "at that step" in verdict


def _corrupt_copy(world: Path, tmp_path: Path) -> tuple[Path, dict[str, Path]]:
    """A copy of the world with two rungs' metrics.jsonl damaged: bad bytes appended to one, a line
    mid-file replaced by garbage in the other. Returns (cwd, {damage: the damaged file})."""
    w = tmp_path / "w"
    shutil.copytree(world, w, ignore=shutil.ignore_patterns("root_list"))
    runs = w / ".ladder" / "runs" / "errs"
    damaged = {"bytes": next(runs.glob("r16-*")) / "metrics.jsonl", "mid-file": next(runs.glob("r24-*")) / "metrics.jsonl"}
    with open(damaged["bytes"], "ab") as f:
        f.write(b"\xff\xfe\x00garbage\n")
    lines = damaged["mid-file"].read_bytes().split(b"\n")
    lines[5] = b'{"step": 5, "loss": 3.'  # a torn record in the middle
    damaged["mid-file"].write_bytes(b"\n".join(lines))
    return w, damaged


@pytest.mark.slow
def test_a_damaged_metrics_file_is_skipped_line_by_line_with_one_warning_naming_it(world, tmp_path, mlflow_template):
    """Every reader of a run skips a damaged line with one warning naming the file and line: bytes
    appended at the end (a write cut short) and a torn line mid-file, in two rungs of one ladder."""
    w, damaged = _corrupt_copy(world, tmp_path)
    shutil.copy(mlflow_template, w / ".ladder" / "mlflow.db")
    n_lines = len(damaged["bytes"].read_bytes().split(b"\n")) - 1
    where = {"bytes": f"{damaged['bytes']}:{n_lines}", "mid-file": f"{damaged['mid-file']}:6"}
    both = tuple(damaged)
    readers = [  # (argv, the damaged files it reads)
        (["status", "exp.py"], both),
        (["forecast", "exp.py", "--no-tracking"], both),
        (["report", "exp.py", "--out", tmp_path / "rep", "--no-tracking"], both),
        (["sync", "errs"], both),
        (["submit", "exp.py", "--no-tracking"], both),  # every rung finished: nothing to train, nothing to fail
        *((["compare", m.parent], (how,)) for how, m in damaged.items()),
    ]
    # finished runs: train says so, and leaves their metrics as they are (the readers beside it
    # still see the damage)
    trains = [(["train", m.parent / "spec.yaml", "--run-dir", m.parent, "--quiet"], (how,)) for how, m in damaged.items()]
    before = {how: m.read_bytes() for how, m in damaged.items()}
    results = ladder_each([a for a, _ in readers + trains], w)
    assert {how: m.read_bytes() for how, m in damaged.items()} == before
    problems = []
    for (argv, reads), r in zip(readers + trains, results):
        warnings = [ln for ln in r.stderr.splitlines() if "skipped a bad metrics line" in ln]
        # status, submit and train (the submission's worker) read a finished run's last record
        # only, from the file's end: the bytes appended there are on their way, a line mid-file is not
        end_reader = argv[0] in ("status", "submit", "train")
        want = sorted(where[how] for how in reads if not (how == "mid-file" and end_reader))
        ok = r.returncode == 0 and "Traceback" not in r.stderr and "codec can't decode" not in r.stderr
        named = sorted(next((x for x in where.values() if x in ln), ln) for ln in warnings)
        if not ok or named != want:
            problems.append(f"{argv[0]}: exit {r.returncode}, warnings {named} (want {want}), stderr {r.stderr[-600:]!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_a_nan_final_eval_loss_of_a_rung_is_named_in_the_forecast_warnings(world, tmp_path):
    w = tmp_path / "w"
    shutil.copytree(world, w, ignore=shutil.ignore_patterns("root_list"))
    m = next((w / ".ladder" / "runs" / "errs").glob("r24-*")) / "metrics.jsonl"
    recs = [json.loads(x) for x in m.read_text().splitlines()]
    assert recs[-1].get("eval_loss") is not None
    recs[-1]["eval_loss"] = float("nan")
    recs[-2]["eval_loss"] = 4.5  # an earlier eval the forecast falls back on
    m.write_text("".join(json.dumps(r) + "\n" for r in recs))
    r = ladder("forecast", "exp.py", "--no-tracking", "--json", cwd=w)
    assert r.returncode == 0, r.stderr
    fc = json.loads(r.stdout)
    said = [x for x in fc.get("warnings", []) if "r24" in x]
    assert len(said) == 1 and f"last step {STEPS - 1}" in said[0] and "4.5000" in said[0], fc.get("warnings")
    assert "warning: rung r24" in r.stderr
