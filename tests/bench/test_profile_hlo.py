"""bench/profile_h200.py's HLO lookup names what each fusion of a compiled JAX step computes:
its output shape, JAX op and the source line it came from. Checked on a step compiled here (the
CPU's XLA writes the same module format as the GPU's)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from profile_h200 import hlo_sources  # noqa: E402


def _step(x, w):
    y = jax.nn.silu(x @ w)  # the line the matmul fusion comes from
    return jnp.sum(y.astype(jnp.float32) ** 2)


def test_each_fusion_is_named_with_its_shape_op_and_source_line():
    hlo = jax.jit(_step).lower(jnp.ones((8, 16), jnp.bfloat16), jnp.ones((16, 4), jnp.bfloat16)).compile().as_text()
    what = hlo_sources(hlo, under="tests/bench/")
    assert what and all("." not in name for name in what)  # kernel names: '.' as '_'
    line = _step.__code__.co_firstlineno + 1
    here = [v for v in what.values() if f"tests/bench/test_profile_hlo.py:{line}" in v]
    assert here, what
    assert any(v.startswith(("bf16[8,4]", "f32[8,4]")) for v in what.values()), what


def test_a_module_without_source_tables_still_lists_its_fusions():
    hlo = "\n".join([
        "HloModule m",
        "  %loop_convert_fusion.12 = f32[131072,1024]{1,0} fusion(bf16[131072,1024]{1,0} %p), kind=kLoop, "
        'calls=%c, metadata={op_name="jit(step)/convert_element_type"}',
    ])
    assert hlo_sources(hlo) == {"loop_convert_fusion_12": "f32[131072,1024] convert_element_type"}
