"""The GPU grouped matmul of the JAX engine (engines/jax/fast.py): its custom VJP and the dropless
dispatch built on it equal lax.ragged_dot and moe.dropless_experts. On the CPU the Mosaic-GPU
kernels are stood in for by lax.ragged_dot(_general) with the same argument conventions, so what
is tested is the plumbing around them (transposes, the weight gradient, sorting, gates)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from engines.jax import fast, moe


def _ref_kernels():
    def rd(x, w, *, group_sizes, transpose_rhs=False, **_):
        return lax.ragged_dot(x, jnp.swapaxes(w, 1, 2) if transpose_rhs else w, group_sizes)

    def trd(x, g, *, group_sizes, **_):
        dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
        return lax.ragged_dot_general(x, g, group_sizes, ragged_dot_dimension_numbers=dims)

    return rd, trd


@pytest.fixture(autouse=True)
def _stand_in_kernels(monkeypatch):
    monkeypatch.setattr(fast, "_kernels", _ref_kernels)


def test_grouped_matmul_gradients_equal_ragged_dot():
    ks = jax.random.split(jax.random.key(0), 2)
    x, w = jax.random.normal(ks[0], (40, 8)), jax.random.normal(ks[1], (3, 8, 6))
    sizes = jnp.array([10, 0, 30], jnp.int32)  # an empty group too
    got = jax.grad(lambda x, w: jnp.sum(jnp.sin(fast.mgpu_gmm(x, w, sizes))), (0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(jnp.sin(lax.ragged_dot(x, w, sizes))), (0, 1))(x, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vjp", [True, False], ids=["vjp", "autodiff"])
def test_dropless_dispatch_equals_the_blocked_reference(vjp):
    with jax.default_matmul_precision("highest"):  # a GPU's fp32 default is TF32: 1e-3 apart
        _dropless_dispatch_equals_the_blocked_reference(vjp)


def _dropless_dispatch_equals_the_blocked_reference(vjp):
    T, K, E, L, F = 24, 2, 4, 8, 6
    ks = jax.random.split(jax.random.key(1), 6)
    x = jax.random.normal(ks[0], (T, L))
    expert = jax.random.randint(ks[1], (T, K), 0, E)
    gate = jax.random.uniform(ks[2], (T, K))
    ws = (jax.random.normal(ks[3], (E, L, F)), jax.random.normal(ks[4], (E, L, F)),
          jax.random.normal(ks[5], (E, F, L)))

    def loss(fn):
        return lambda x, gate, *w: jnp.sum(jnp.sin(fn(x, expert, gate, *w, dtype=jnp.float32)))

    def mgpu(*a, **kw):
        return fast.dropless_mgpu(*a, **kw, vjp=vjp)

    np.testing.assert_allclose(loss(mgpu)(x, gate, *ws), loss(moe.dropless_experts)(x, gate, *ws), rtol=1e-5)
    got = jax.grad(loss(mgpu), (0, 1, 2, 3, 4))(x, gate, *ws)
    want = jax.grad(loss(moe.dropless_experts), (0, 1, 2, 3, 4))(x, gate, *ws)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_vjp_equals_autodiff_of_the_fp32_swiglu(dtype):
    gu = (2.0 * jax.random.normal(jax.random.key(7), (40, 12))).astype(dtype)
    dh = jax.random.normal(jax.random.key(8), (40, 6)).astype(dtype)

    def plain(gu):
        g, u = gu[:, :6].astype(jnp.float32), gu[:, 6:].astype(jnp.float32)
        return (jax.nn.silu(g) * u).astype(dtype)

    got, got_vjp = jax.vjp(fast.swiglu, gu)
    want, want_vjp = jax.vjp(plain, gu)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    (g,), (r,) = got_vjp(dh), want_vjp(dh)
    assert g.dtype == dtype
    tol = 1e-6 if dtype == jnp.float32 else 2**-7
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_combine_vjp_equals_autodiff_of_the_gated_sum(dtype):
    T, K, L = 12, 3, 5
    e_A = jax.random.randint(jax.random.key(9), (T * K,), 0, 4)
    order = jnp.argsort(e_A, stable=True)
    inv = fast.inverse_permutation(order)
    y_sorted = jax.random.normal(jax.random.key(10), (T * K, L)).astype(dtype)
    gate = jax.random.uniform(jax.random.key(11), (T, K))
    g_TL = jax.random.normal(jax.random.key(12), (T, L))

    def plain(y_sorted, gate):
        y_TKL = y_sorted[inv].reshape(T, K, L).astype(jnp.float32)
        return jnp.sum(y_TKL * gate[..., None], axis=1)

    got, got_vjp = jax.vjp(lambda y, g: fast.combine(y, g, inv, order, K), y_sorted, gate)
    want, want_vjp = jax.vjp(plain, y_sorted, gate)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for g, r in zip(got_vjp(g_TL), want_vjp(g_TL)):
        assert g.dtype == r.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=1e-5, atol=1e-6)


def test_kernels_are_used_only_where_they_apply():
    assert not fast.mgpu_usable(1024, 512, jnp.float32)  # fp32: the reference path
    assert not fast.mgpu_usable(1000, 512, jnp.bfloat16)  # widths that do not tile


def test_each_expert_matmul_gets_its_tuned_tiles(monkeypatch):
    """The six matmuls of a gate|up 1024 -> 1024 and down 512 -> 1024 layer, forward and backward,
    ask the kernels for MGPU_TUNED's tiles; other widths, and jax_mgpu "default", for MGPU's."""
    seen = []
    rd0, trd0 = _ref_kernels()

    def rd(x, w, *, group_sizes, transpose_rhs=False, block_m, block_n, block_k, max_concurrent_steps,
           grid_block_n):
        cfg = dict(zip(fast._T, (block_m, block_n, block_k, max_concurrent_steps, grid_block_n)))
        seen.append(("dx" if transpose_rhs else "fwd", cfg))
        return rd0(x, w, group_sizes=group_sizes, transpose_rhs=transpose_rhs)

    def trd(x, g, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps, grid_block_n):
        seen.append(("dw", dict(zip(fast._T, (block_m, block_n, block_k, max_concurrent_steps, grid_block_n)))))
        return trd0(x, g, group_sizes=group_sizes)

    monkeypatch.setattr(fast, "_kernels", lambda: (rd, trd))
    sizes = jnp.array([6, 10], jnp.int32)

    def layer(x, wgu, wd, choice=fast.TUNED):
        return jnp.sum(fast.mgpu_gmm(fast.mgpu_gmm(x, wgu, sizes, choice)[:, :512], wd, sizes, choice))

    x, wgu, wd = jnp.ones((16, 1024)), jnp.ones((2, 1024, 1024)), jnp.ones((2, 512, 1024))
    jax.grad(layer, (0, 1, 2))(x, wgu, wd)
    want = [fast.MGPU_TUNED[k] for k in [("fwd", 1024, 1024), ("fwd", 512, 1024), ("dx", 1024, 512),
                                          ("dw", 512, 1024), ("dx", 1024, 1024), ("dw", 1024, 1024)]]
    assert [c for _, c in seen] == want
    assert all(c != fast.MGPU for c in want)
    seen.clear()
    jax.grad(layer, (0, 1, 2))(jnp.ones((16, 768)), jnp.ones((2, 768, 1024)), wd)
    assert [c for _, c in seen][0] == fast.MGPU  # an untuned width
    seen.clear()
    jax.grad(layer, (0, 1, 2))(x, wgu, wd, ("default", None))
    assert all(c == fast.MGPU for _, c in seen) and len(seen) == 6


def _float_scatter_adds(jaxpr) -> list:
    """scatter-add equations on floating-point operands, nested jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scatter-add" and jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating):
            found.append(eqn)
        for v in eqn.params.values():
            inner = getattr(v, "jaxpr", None)
            if inner is not None:
                found += _float_scatter_adds(getattr(inner, "jaxpr", inner))
    return found


def test_dropless_backward_has_no_float_scatter_add():
    """The dispatch and combine permutations transpose to gathers: XLA's atomic scatter-add
    (12 ms of a 140 ms H200 step) must not appear in the gradient (the integer one of bincount,
    which counts rows per expert, may)."""
    T, K, E, L, F = 16, 2, 4, 8, 6
    ks = jax.random.split(jax.random.key(2), 5)
    x, gate = jax.random.normal(ks[0], (T, L)), jax.random.uniform(ks[1], (T, K))
    expert = jax.random.randint(ks[2], (T, K), 0, E)
    ws = (jax.random.normal(ks[3], (E, L, F)),) * 2 + (jax.random.normal(ks[4], (E, F, L)),)
    loss = lambda x, *w: jnp.sum(fast.dropless_mgpu(x, expert, gate, *w, dtype=jnp.float32))  # noqa: E731
    grad_jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2, 3)))(x, *ws).jaxpr
    assert _float_scatter_adds(grad_jaxpr) == []
    # the plain-indexing version of the same dispatch does scatter-add: the check can fail
    plain = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(x[jnp.argsort(expert.reshape(-1)) // K])))(x).jaxpr
    assert _float_scatter_adds(plain)


def test_partial_inverse_names_each_rows_reader_and_gather_rows_transposes_by_it():
    N, M = 6, 10
    idx_M = jnp.array([6, 2, 6, 0, 5, 6, 6, 3, 6, 6], jnp.int32)  # rows 1 and 4 unread; 6: the zero row
    inv_N = fast.partial_inverse(idx_M, N)
    assert inv_N.tolist() == [3, 10, 1, 7, 10, 4]
    x = jax.random.normal(jax.random.key(4), (N, 3))
    g = jax.random.normal(jax.random.key(5), (M, 3))
    got = jax.vjp(lambda x: fast.gather_rows(x, idx_M, inv_N), x)[1](g)[0]
    want = jax.vjp(lambda x: jnp.concatenate([x, jnp.zeros((1, 3))])[idx_M], x)[1](g)[0]
    np.testing.assert_array_equal(got, want)


def test_sorted_counts_equal_bincount_and_the_inverse_permutation_inverts():
    e = jax.random.randint(jax.random.key(6), (50,), 0, 7)  # some of the 9 values never occur
    order = jnp.argsort(e, stable=True)
    np.testing.assert_array_equal(fast.sorted_counts(e[order], 9), jnp.bincount(e, length=9))
    inv = fast.inverse_permutation(order)
    np.testing.assert_array_equal(order[inv], jnp.arange(50))


def test_a_tile_file_comes_before_the_built_in_tiles_and_a_bad_one_is_named(tmp_path):
    import json

    x, w = jnp.ones((16, 768)), jnp.ones((2, 768, 1024))
    mine = {"block_m": 64, "block_n": 128, "block_k": 64, "max_concurrent_steps": 5, "grid_block_n": 2}
    over = {"block_m": 64, "block_n": 256, "block_k": 64, "max_concurrent_steps": 3, "grid_block_n": 1}
    path = tmp_path / "mgpu_tiles.json"
    path.write_text(json.dumps({"tiles": [{"op": "fwd", "m": 768, "n": 1024, "config": mine},
                                          {"op": "fwd", "m": 1024, "n": 1024, "config": over}]}))
    assert fast.mgpu_config("fwd", x, w) == fast.MGPU  # an untuned width
    choice = ("1", str(path))
    assert fast.mgpu_config("fwd", x, w, choice=choice) == mine
    assert fast.mgpu_config("fwd", jnp.ones((16, 1024)), jnp.ones((2, 1024, 1024)), choice=choice) == over
    assert (fast.mgpu_config("dw", jnp.ones((16, 1024)), jnp.ones((16, 1024)), choice=choice)
            == fast.MGPU_TUNED[("dw", 1024, 1024)])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"tiles": [{"op": "fwd", "m": 768, "n": 1024, "config": {"block_m": 64}}]}))
    with pytest.raises(ValueError, match=r"(?s)bad.json.*missing block_k, block_n"):
        fast.mgpu_config("fwd", x, w, choice=("1", str(bad)))


@pytest.mark.parametrize("dtype,width", [(jnp.bfloat16, 64), (jnp.float32, 64), (jnp.bfloat16, 7)])
def test_take_rows_moves_the_same_rows_bitwise(dtype, width):
    """Rows of a 16-bit dtype and even width move as 32-bit words; every form gives x[idx] bitwise."""
    x_NL = jax.random.normal(jax.random.key(0), (40, width)).astype(dtype)
    idx_M = jax.random.randint(jax.random.key(1), (97,), 0, 40)
    got = fast.take_rows(x_NL, idx_M)
    assert got.dtype == x_NL.dtype and got.shape == (97, width)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(x_NL[idx_M].astype(jnp.float32)))
    hlo = jax.jit(fast.take_rows).lower(x_NL, idx_M).as_text()
    assert ("xui32>" in hlo) == (dtype == jnp.bfloat16 and width % 2 == 0)  # the gather of words
