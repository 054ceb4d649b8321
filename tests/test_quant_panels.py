"""Weight-only weights laid out as panels of sixteen outputs (``kernels/quant_panels.py``) and their
product (``kernels/cpu/quant_panels.cc``, AVX512-VNNI builds), against the float64 oracles of
``test_quant_matmul.py``: x rounded to 16 bits per run of 32 inputs, or with int8 activations to
Q8_1's integers. The layout itself is plain JAX and is checked everywhere."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_quant_matmul import _case, _kernel_bound, _oracle, _rounded_oracle_bound

from jaxrunner import kernels
from jaxrunner.kernels import native
from jaxrunner.models import quant

needs_panels = pytest.mark.skipif(not native.stored_panels(),
                                  reason="the native library has no panel kernel here (AVX512-VNNI builds)")
FORMATS = [("int8", 32), ("int4", 32), ("int4", 64)]


def _leaf(fmt, group, scales, k=192, n=80, seed=0):
    rng = np.random.default_rng(seed)
    leaf = quant.quantize_weight_only(rng.standard_normal((k, n)).astype(np.float32), fmt, group)
    return {name: part if name == "packed" else part.astype(scales) for name, part in leaf.items()}


def _assert_within_kernel_bound(got, x, leaf):
    """``got`` is x times the leaf within the native kernel's bound (x rounded to 16 bits per run)."""
    got = np.asarray(got)
    want, _ = _oracle(x, leaf)
    assert got.dtype == np.float32 and got.shape == want.shape
    bound = _kernel_bound(x, leaf)
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))


@pytest.mark.parametrize("fmt,group", FORMATS)
@pytest.mark.parametrize("scales", [np.float32, np.float16])
def test_layout_gives_the_leaf_back_bit_for_bit(fmt, group, scales):
    leaf = _leaf(fmt, group, scales, n=48)
    w = {name: jnp.asarray(part) for name, part in leaf.items()}
    panels = kernels.to_panels(w)
    assert (panels.n, panels.k, panels.int4) == (48, 192, fmt == "int4")
    assert (panels.offsets is None) == ("offsets" not in leaf)
    back = kernels.from_panels(panels)
    assert sorted(back) == sorted(leaf)
    for name, part in leaf.items():
        np.testing.assert_array_equal(np.asarray(back[name]), part)
        assert back[name].dtype == part.dtype
    like = panels.plain_like()
    assert {name: (s.shape, s.dtype) for name, s in like.items()} == {n: (p.shape, p.dtype) for n, p in leaf.items()}


def test_layout_puts_four_bytes_of_each_output_in_a_dword():
    """Byte 4q + b of output o's run r at r * 256 + 64 q + 4 o + b of its panel (int4)."""
    leaf = _leaf("int4", 32, np.float16, k=64, n=32)
    panels = np.asarray(kernels.to_panels({name: jnp.asarray(part) for name, part in leaf.items()}).codes)
    packed = leaf["packed"]
    for n, r, q, b in [(0, 0, 0, 0), (17, 1, 3, 2), (31, 0, 2, 3)]:
        p, o = divmod(n, 16)
        assert panels[p, r * 256 + 64 * q + 4 * o + b] == packed[n, 16 * r + 4 * q + b]


@pytest.mark.parametrize("fmt,group", FORMATS)
def test_rows_read_out_of_panels_are_the_leafs_rows(fmt, group):
    """An embedding lookup in a tied table laid out as panels: any ids, in any shape."""
    leaf = {name: jnp.asarray(part) for name, part in _leaf(fmt, group, np.float16, n=64).items()}
    ids = jnp.asarray([[0, 17, 63], [16, 15, 17]], jnp.int32)
    got = kernels.panel_rows(kernels.to_panels(leaf), ids)
    assert sorted(got) == sorted(leaf)
    for name, part in leaf.items():
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(part)[np.asarray(ids)])


def test_only_whole_panels_and_runs_fit():
    assert kernels.fits_panels(_leaf("int4", 32, np.float16, n=32))
    assert not kernels.fits_panels(_leaf("int4", 32, np.float16, n=40))  # not whole panels of 16 outputs
    assert not kernels.fits_panels(_leaf("int8", 32, np.float16, n=16, k=48))  # not whole runs of 32


@needs_panels
@pytest.mark.parametrize("fmt,group", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17, 70])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("scales", [np.float32, np.float16])
def test_panel_product_matches_float64_oracle(fmt, group, rows, dtype, scales):
    """Rows in passes of eight and a remainder; one or two rows with the split dpbusd chains."""
    x, _, _ = _case(fmt, group, rows, dtype, n=96)
    leaf = _leaf(fmt, group, scales, n=96)
    panels = kernels.to_panels({name: jnp.asarray(part) for name, part in leaf.items()})
    _assert_within_kernel_bound(jax.jit(kernels.panel_matmul)(x, panels), x, leaf)


@needs_panels
@pytest.mark.parametrize("fmt,group,k", [("int8", 32, 544), ("int4", 32, 544), ("int4", 64, 576)])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_panel_product_with_int8_activations_matches_the_rounded_oracle(fmt, group, k, rows):
    x, _, _ = _case(fmt, group, rows, jnp.float32, k=k, n=32, seed=6)
    x = x * jnp.asarray(np.repeat(np.random.default_rng(7).uniform(0.01, 100, (rows, k // 32)), 32, axis=1),
                        jnp.float32)
    leaf = _leaf(fmt, group, np.float16, k=k, n=32, seed=6)
    panels = kernels.to_panels({name: jnp.asarray(part) for name, part in leaf.items()})
    got = np.asarray(jax.jit(functools.partial(kernels.panel_matmul, int8_activations=True))(x, panels))
    want, bound = _rounded_oracle_bound(x, leaf)
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))


@needs_panels
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_big_products_spread_over_the_pool(fmt):
    """Over 4 MiB of codes: XLA's threads join where there are more than two."""
    x, _, _ = _case(fmt, 32, 20, jnp.float32, k=576, n=16)
    leaf = _leaf(fmt, 32, np.float16, k=576, n=16384 if fmt == "int4" else 8192)
    panels = kernels.to_panels({name: jnp.asarray(part) for name, part in leaf.items()})
    _assert_within_kernel_bound(jax.jit(kernels.panel_matmul)(x, panels), x, leaf)


@needs_panels
def test_panel_product_refuses_a_mismatched_x():
    panels = kernels.to_panels({name: jnp.asarray(part) for name, part in _leaf("int4", 32, np.float16).items()})
    with pytest.raises(ValueError, match=r"x must be \[rows, 192\] bf16 or float32"):
        kernels.panel_matmul(jnp.zeros((2, 160), jnp.float32), panels)


@needs_panels
def test_panel_product_loads_the_library_itself():
    """The first native call of a process may be a panel product (the kernel registers itself)."""
    import subprocess
    import sys
    code = ("import jax.numpy as jnp, numpy as np\n"
            "from jaxrunner import kernels\n"
            "w = kernels.to_panels({'packed': jnp.zeros((16, 16), jnp.uint8), 'scales': jnp.ones((16, 1), jnp.float16)})\n"
            "print(float(np.asarray(kernels.panel_matmul(jnp.ones((1, 32), jnp.float32), w)).sum()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "0.0"
