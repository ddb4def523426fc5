import json
from pathlib import Path

import pytest

from core import costs
from ladder.presets import micro_spec
from tests import cli_fork

ROOT = Path(__file__).resolve().parents[2]


def test_param_counts_match_a_hand_count_of_the_micro_model():
    # d 32, 2 layers, 4 heads x 8, 2 KV heads, vocab 256, 8 experts top-2 of hidden 16 in latent 16,
    # 1 shared expert of hidden 32
    pc = costs.param_counts(micro_spec().model)
    attn = 32 * 32 * 2 + 32 * 16 * 2  # wq, wo + wk, wv
    router = 32 * 8
    latent = 2 * 32 * 16
    expert = 3 * 16 * 16
    shared = 3 * 32 * 32
    assert pc["embedding"] == pc["lm_head"] == 256 * 32
    assert pc["routed_experts"] == 2 * 8 * expert
    assert pc["total"] == 2 * 256 * 32 + 2 * (attn + router + latent + 8 * expert + shared)
    assert pc["active"] == 2 * (attn + router + latent + 2 * expert + shared)


def test_mean_context_counts_keys_under_causal_and_window_masks():
    assert costs.mean_context(4, None) == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert costs.mean_context(4, 2) == pytest.approx((1 + 2 + 2 + 2) / 4)


def test_flops_per_token_is_six_n_plus_head_plus_attention():
    s = micro_spec()
    pc = costs.param_counts(s.model)
    ctx = costs.mean_context(64, 32)
    expect = 6 * (pc["active"] + pc["lm_head"]) + 3 * 4 * 2 * ctx * 4 * 8
    assert costs.flops_per_token(s) == pytest.approx(expect)
    assert costs.total_flops(s) == pytest.approx(expect * 100 * 64 * 8)


def test_a2a_bytes_halve_with_the_latent_and_vanish_without_ep():
    m = micro_spec().model  # latent 16 of d 32, ep 2
    assert costs.a2a_bytes_per_token(m, latent=True) == pytest.approx(4 * 2 * 2 * 16 * 2 * 0.5)
    assert costs.a2a_bytes_per_token(m, latent=False) == pytest.approx(2 * costs.a2a_bytes_per_token(m, latent=True))
    assert costs.a2a_bytes_per_token(m.model_copy(update={"ep_size": 1})) == 0


def test_gpu_hours_follow_flops_over_peak_times_mfu():
    s = micro_spec(**{"hardware.peak_flops": 1e12, "hardware.expected_mfu": 0.5, "hardware.n_gpus": 2})
    assert costs.gpu_hours(s) == pytest.approx(costs.total_flops(s) / 0.5e12 / 3600)
    assert costs.wall_days(s) == pytest.approx(costs.gpu_hours(s) / 2 / 24)


def test_memory_shards_experts_over_the_ep_domain():
    s = micro_spec(**{"hardware.n_gpus": 8, "hardware.ep_domain": 8})
    wide = costs.memory_per_gpu(s)
    narrow = costs.memory_per_gpu(s.replace(**{"hardware.ep_domain": 1}))
    assert narrow["weights_grads_optimizer"] > wide["weights_grads_optimizer"]


@pytest.fixture(scope="module")
def marin_plan():
    out = cli_fork.ladder("plan", ROOT / "experiments/marin_535b.py", "--json", cwd=ROOT)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    return data, {r["name"]: r for r in data["rungs"]}


@pytest.mark.parametrize("name,total,active", [("d768", 1.6e9, 61e6), ("d2048", 27.7e9, 1.17e9), ("d6144", 535e9, 23e9)])
def test_marin_plan_reproduces_published_parameter_counts(marin_plan, name, total, active):
    # d2048's active count is published as "1.2B", a rounding of 926B tokens / 791 tokens per
    # active parameter = 1.171B, which is what the shape rule gives.
    r = marin_plan[1][name]
    assert r["total_params"] == pytest.approx(total, rel=0.02)
    assert r["active_params"] == pytest.approx(active, rel=0.02)


def test_marin_hero_flops_and_tokens_per_active_param(marin_plan):
    hero = marin_plan[1]["d6144"]
    assert hero["flops"] == pytest.approx(2.7e24, rel=0.05)
    for r in marin_plan[1].values():
        assert r["tokens_per_active_param"] == pytest.approx(791, rel=0.01)


def test_marin_ladder_is_a_small_share_of_hero_compute(marin_plan):
    share = marin_plan[0]["ladder_share_of_hero"]
    assert 0.001 < share < 0.02


def test_plan_of_a_missing_file_is_a_clear_error():
    out = cli_fork.ladder("plan", "nope.py", cwd=ROOT)
    assert out.returncode == 2 and "nope.py: no such experiment file" in out.stderr
