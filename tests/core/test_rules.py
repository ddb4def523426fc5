"""core.rules: the compute -> batch rule."""

import pytest

from core.rules import scaled_batch


def test_scaled_batch_keeps_steps_about_equal_at_a_fixed_token_ratio():
    # 1/64 of the reference compute at exponent 0.5: the batch / 8
    assert scaled_batch(1e15, 64e15, 64) == 8
    assert scaled_batch(64e15, 64e15, 64) == 64


def test_scaled_batch_rounds_to_a_power_of_two_in_log_scale():
    assert scaled_batch(1e15, 3e15, 64) == 32  # 36.9 -> 32
    assert scaled_batch(1e15, 2e15, 64, exponent=1.0) == 32


def test_scaled_batch_stays_within_its_floor_and_the_reference():
    assert scaled_batch(1e10, 1e17, 64, min_batch=8) == 8
    assert scaled_batch(1e18, 1e17, 64) == 64


def test_scaled_batch_refuses_nonpositive_compute():
    with pytest.raises(ValueError, match="positive"):
        scaled_batch(0.0, 1e15, 64)
