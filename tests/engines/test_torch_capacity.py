"""Capacity (pooled-wave) dispatch on hand-built routings: drops exactly as the bounds say."""

import numpy as np
import pytest
import torch

from engines.dispatch_ref import capacities, capacity_plan as ref_plan
from engines.options import TorchKernels
from engines.torch.dispatch import capacity_plan
from engines.torch.forward import moe_combine, moe_experts, moe_weights
from engines.torch.model import MoE, init_params
from ladder.presets import micro_spec


def _plan(expert_TK, E, ep, W, cf_s=1.0, cf_r=1.0):
    return capacity_plan(torch.tensor(expert_TK), E, ep, W, cf_s, cf_r)


# T=8, K=1, E=4, ep=2: tokens 0-3 live on shard 0, 4-7 on shard 1; experts 0-1 on shard 0, 2-3 on shard 1
HAND_ROUTING = [[0], [2], [0], [1], [0], [0], [3], [2]]


def test_hand_check_capacities():
    assert capacities(8, 1, 4, 2, 1, 1.0, 1.0) == (2, 2)


def test_one_wave_drops_at_sender_pool_then_at_receiver_bound():
    p = _plan(HAND_ROUTING, E=4, ep=2, W=1)
    # shard 0 sends tokens 0, 2, 3 to shard 0: pool of 2 rows, token 3 is dropped at the sender
    assert p["send_drop_TK"][:, 0].nonzero().flatten().tolist() == [3]
    # expert 0 receives tokens 0, 2 (source 0) then 4, 5 (source 1): bound 2 drops 4 and 5
    assert p["recv_drop_TK"][:, 0].nonzero().flatten().tolist() == [4, 5]
    assert p["kept_TK"][:, 0].tolist() == [True, True, True, False, False, False, True, True]


def test_two_waves_rank_arrivals_wave_first():
    p = _plan(HAND_ROUTING, E=4, ep=2, W=2)  # C_send = 1 row per wave
    assert p["c_send"] == 1 and p["c_recv"] == 2
    assert p["send_drop_TK"][:, 0].nonzero().flatten().tolist() == [3]  # third row of pair (0, 0)
    # expert 0 arrivals in (wave, source, row) order: 0 (w0,s0), 4 (w0,s1), 2 (w1,s0), 5 (w1,s1)
    assert p["recv_drop_TK"][:, 0].nonzero().flatten().tolist() == [2, 5]


def test_pools_fill_slot_major_so_second_choices_drop_first():
    # E=4, T=4, K=2, ep=1: C_recv = 2; expert 0 is the first choice of tokens 0 and 2, second of 1 and 3
    p = _plan([[0, 1], [1, 0], [0, 2], [3, 0]], E=4, ep=1, W=1)
    assert p["recv_drop_TK"].nonzero().tolist() == [[1, 1], [3, 1]]
    assert not p["send_drop_TK"].any()


@pytest.mark.parametrize("seed", range(12))
def test_device_bookkeeping_equals_the_numpy_reference(seed):
    rng = np.random.default_rng(seed)
    ep = int(rng.choice([1, 2, 4]))
    E = ep * int(rng.integers(1, 4))
    K = int(rng.integers(1, E + 1))
    T = ep * int(rng.integers(1, 12))
    W = int(rng.integers(1, 4))
    cf_s, cf_r = float(rng.uniform(1, 2)), float(rng.uniform(1, 2))
    # skewed routing so both bounds bite; top-k choices of one token are distinct experts
    expert_TK = np.stack([rng.choice(E, K, replace=False, p=rng.dirichlet(np.ones(E) * 0.5)) for _ in range(T)])
    ref = ref_plan(expert_TK, E, ep, W, cf_s, cf_r)
    got = _plan(expert_TK, E, ep, W, cf_s, cf_r)
    assert np.array_equal(got["send_drop_TK"].numpy(), ref.send_drop_TK)
    assert np.array_equal(got["recv_drop_TK"].numpy(), ref.recv_drop_TK)
    assert np.array_equal(got["kept_TK"].numpy(), ref.kept_TK)


def test_tokens_not_divisible_by_ep_is_a_clear_error():
    with pytest.raises(ValueError, match="divisible by ep_size"):
        _plan([[0]] * 5, E=4, ep=2, W=1)


def _moe_out(moe, x_TD, seq_len):
    """The forward's MoE part (engines/torch/forward.py) on one MoE module in fp32 with the
    reference kernels: (y_TD, statistics with the drop fractions)."""
    T, K = x_TD.shape[0], moe.m.top_k
    expert_TK, gate_TK, st = moe.route(x_TD, seq_len)
    w = moe_weights(moe, torch.float32)
    y, n_send, n_recv = moe_experts(moe, w, x_TD, expert_TK, gate_TK, torch.float32, TorchKernels.reference())
    st["drop_send"], st["drop_recv"] = n_send / (T * K), n_recv / (T * K)
    return moe_combine(moe, w, torch.zeros_like(x_TD), x_TD, y, gate_TK, torch.float32), st


def _moe(spec):
    moe = MoE(spec.model)
    params = init_params(spec.model, 3)
    with torch.no_grad():
        for k, t in moe.state_dict().items():
            t.copy_(torch.from_numpy(params[f"blocks.0.moe.{k}"]))
    return moe


def test_capacity_with_ample_factors_equals_dropless():
    spec = micro_spec()
    E, ep = spec.model.n_routed_experts, spec.model.ep_size
    roomy = spec.replace(**{"model.dispatch": "capacity", "model.capacity_factor_send": float(max(E, ep)),
                            "model.capacity_factor_recv": float(E), "model.n_waves": 2})
    x_TD = torch.randn(128, spec.model.d_model, generator=torch.Generator().manual_seed(0))
    y_drop, st_drop = _moe_out(_moe(spec), x_TD, 64)
    y_cap, st_cap = _moe_out(_moe(roomy), x_TD, 64)
    assert float(st_cap["drop_send"]) == 0 and float(st_cap["drop_recv"]) == 0
    torch.testing.assert_close(y_cap, y_drop, rtol=1e-6, atol=1e-6)


def test_tight_capacity_drops_and_dropped_assignments_add_nothing():
    spec = micro_spec(**{"model.dispatch": "capacity", "model.capacity_factor_send": 1.0,
                         "model.capacity_factor_recv": 1.0})
    moe = _moe(spec)
    x_TD = torch.randn(128, spec.model.d_model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        moe.router.mul_(50.0)  # a peaked router overloads some experts
        y, st = _moe_out(moe, x_TD, 64)
        expert_TK, gate_TK, _ = moe.route(x_TD, 64)
        ref = ref_plan(expert_TK.numpy(), 8, 2, 1, 1.0, 1.0)
        assert float(st["drop_send"]) == pytest.approx(ref.drop_frac_send) and ref.drop_frac_send > 0
        assert float(st["drop_recv"]) == pytest.approx(ref.drop_frac_recv)
        # the expected output by hand: kept assignments only, gates not renormalised, plus shared experts
        x_TL = x_TD @ moe.latent_down
        want_TL = torch.zeros_like(x_TL)
        for t in range(128):
            for j in range(spec.model.top_k):
                if ref.kept_TK[t, j]:
                    e = int(expert_TK[t, j])
                    h = torch.nn.functional.silu(x_TL[t] @ moe.experts.w_gate[e]) * (x_TL[t] @ moe.experts.w_up[e])
                    want_TL[t] += gate_TK[t, j] * (h @ moe.experts.w_down[e])
        sh = moe.shared
        shared_TD = sum(torch.nn.functional.silu(x_TD @ sh.w_gate[n]) * (x_TD @ sh.w_up[n]) @ sh.w_down[n]
                        for n in range(spec.model.n_shared_experts))
        want_TD = want_TL @ moe.latent_up + shared_TD
    torch.testing.assert_close(y, want_TD, rtol=1e-5, atol=1e-6)
