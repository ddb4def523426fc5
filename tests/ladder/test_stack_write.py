"""Replan options in the stack's own form: what `stack_form` writes reads back as the option's run."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest
import yaml

from ladder.stack_config import load_stack_config, spec_from_stack
from ladder.stack_write import stack_form
from tests import cli_fork

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[2]
CONFIGS = {
    "olmo-core": (DATA / "olmo_core_olmoe_config.json", {}),
    "levanter": (DATA / "levanter_moe_config.yaml", {}),
    "torchtitan": (DATA / "torchtitan_qwen3_30b_a3b.toml", {"data.batch_size": 64}),
}


def parse(stack: str, text: str) -> dict:
    return {"olmo-core": json.loads, "levanter": yaml.safe_load, "torchtitan": tomllib.loads}[stack](text)


@pytest.mark.parametrize("stack", sorted(CONFIGS))
@pytest.mark.parametrize("decay", ["wsd", "cosine"])
def test_an_option_written_in_the_stacks_form_reads_back_as_the_same_run(stack, decay):
    path, sets = CONFIGS[stack]
    cfg = load_stack_config(path)
    spec = spec_from_stack(stack, cfg, "orig", dict(sets), str(path))
    sched = {"schedule.decay": decay, "schedule.min_lr_ratio": 0.05, "schedule.warmup_steps": 7}
    if decay == "wsd":
        sched["schedule.decay_start_frac"] = 0.75
    option = spec.replace(**{"data.total_tokens": spec.data.tokens_per_step * 400, "optim.peak_lr": 1.5e-4, **sched})
    text, notes = stack_form(stack, cfg, option, resume_step=120,
                             text=path.read_text() if path.suffix == ".toml" else None)
    back = spec_from_stack(stack, parse(stack, text), "back", dict(sets), "written")
    assert back.total_steps == 400 and back.optim.peak_lr == pytest.approx(1.5e-4)
    assert back.schedule.decay == decay and back.schedule.min_lr_ratio == pytest.approx(0.05)
    assert back.schedule.warmup_steps == 7
    if decay == "wsd":
        assert back.schedule.decay_start_frac == pytest.approx(0.75)
    assert back.model == option.model


def test_the_torchtitan_form_keeps_the_files_comments_and_sets_the_resume_step():
    path = CONFIGS["torchtitan"][0]
    cfg = load_stack_config(path)
    spec = spec_from_stack("torchtitan", cfg, "o", {"data.batch_size": 64}, str(path))
    text, _ = stack_form("torchtitan", cfg, spec, resume_step=5, text=path.read_text())
    assert "# lr scheduler warm up" in text and tomllib.loads(text)["checkpoint"]["load_step"] == 5


def test_what_a_stack_form_cannot_say_is_named():
    path = CONFIGS["olmo-core"][0]
    cfg = load_stack_config(path)
    spec = spec_from_stack("olmo-core", cfg, "o", {}, str(path))
    _, notes = stack_form("olmo-core", cfg, spec.replace(**{"schedule.decay_end_frac": 0.9}))
    assert any("decay_end_frac" in n for n in notes)


def test_replan_writes_each_option_in_the_runs_own_stack_form_too(tmp_path):
    import numpy as np

    from core.schedule import lr_at
    from core.spec import load_spec
    from ladder.presets import micro_spec

    spec = micro_spec("s400", **{"data.total_tokens": 64 * 8 * 400})
    (tmp_path / "s.yaml").write_text(spec.to_yaml())
    steps = np.arange(60)
    (tmp_path / "m.csv").write_text("step,loss,lr,time\n" + "".join(
        f"{i},{2 + 3 * (i + 1) ** -0.3:.5f},{lr_at(spec, [i])[0]:.8g},{1.7e9 + 10 * i}\n" for i in steps))
    toml = CONFIGS["torchtitan"][0]
    out = cli_fork.ladder("replan", "--metrics", tmp_path / "m.csv", "--spec", tmp_path / "s.yaml", "--stack-config", toml,
                          "--out", tmp_path / "out", "--days", "0.01", "--json", cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    written = rep["paths"]["shorten.torchtitan"]
    option = load_spec(rep["paths"]["shorten"])
    assert tomllib.loads(Path(written).read_text())["training"]["steps"] == option.total_steps
    assert any("rejoins" in n for n in rep["stack_forms"][written])  # the re-timed decay is named, not dropped
