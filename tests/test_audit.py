"""The StableHLO Metal-hazard audit (DESIGN §4, issue 8).

* jaxkv's decode step, prefill chunk, compiled decode loop (greedy and sampling) and the
  KIVI kernels lower to StableHLO free of every hazard, for every cache mode
  (fp32/fp16/bf16/int8/int4/int2 x full/streaming x absolute/cache);
* the audit itself is tested: it reports a ``uint32`` index (dynamic_slice,
  dynamic_update_slice, gather, scatter), ``f64`` (lowered with ``jax_enable_x64`` in a
  subprocess, and a hand-written module), ``int4``, complex numbers, scatter and popcnt,
  and stays quiet on ``uint8`` data and ``uint32`` PRNG arithmetic.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jaxkv.eval import audit


@pytest.mark.parametrize("mode", audit.MODES, ids=["/".join(m) for m in audit.MODES])
def test_every_cache_mode_is_free_of_metal_hazards(mode):
    """Greedy decode loop for every mode; the sampling rules (which do not depend on the
    cache) also with temperature/top-k/top-p for two modes, to keep the test fast."""
    samplers = (
        ("greedy", "temperature")
        if mode in (("fp32", "streaming", "absolute"), ("int4", "streaming", "cache"))
        else ("greedy",)
    )
    programs = audit.audit_cache_mode(audit.mode_spec(*mode), samplers=samplers)
    expected = {"forward", "forward T=4"} | {f"_decode_block {s}" for s in samplers}
    if "int" in mode[0]:  # keys or values in KIVI codes
        expected.add("kivi kernels")
    assert set(programs) == expected
    assert {name: findings for name, findings in programs.items() if findings} == {}


def kinds(findings):
    return {f.split(": ")[1] for f in findings}


def test_uint32_index_is_reported():
    x = jnp.arange(8.0)
    i = jnp.uint32(3)
    findings = audit.audit_function(lambda x, i: lax.dynamic_slice(x, (i,), (2,)), x, i)
    assert kinds(findings) == {"unsigned-index"} and "ui32" in findings[0] and "dynamic_slice" in findings[0]
    assert kinds(audit.audit_function(lambda x, i: x[i], x, i)) == {"unsigned-index"}
    assert kinds(audit.audit_function(lambda x, i: lax.dynamic_update_slice(x, jnp.ones(2), (i,)), x, i)) == {
        "unsigned-index"
    }
    dn = lax.GatherDimensionNumbers(offset_dims=(), collapsed_slice_dims=(0,), start_index_map=(0,))
    idx = jnp.array([[1], [2]], jnp.uint32)
    assert kinds(audit.audit_function(lambda x, i: lax.gather(x, i, dn, (1,)), x, idx)) == {"unsigned-index"}
    # the same programs with int32 indices are clean
    assert audit.audit_function(lambda x, i: lax.dynamic_slice(x, (i,), (2,)), x, jnp.int32(3)) == []
    assert audit.audit_function(lambda x, i: lax.gather(x, i, dn, (1,)), x, idx.astype(jnp.int32)) == []


def test_uint8_data_and_prng_uint32_are_not_index_hazards():
    codes = jnp.arange(16, dtype=jnp.uint8)
    assert audit.audit_function(lambda c, i: (lax.dynamic_slice(c, (i,), (4,)) >> 4) & 15, codes, jnp.int32(2)) == []
    assert audit.audit_function(lambda k: jax.random.categorical(k, jnp.zeros((2, 8))), jax.random.PRNGKey(0)) == []


def test_scatter_int4_complex_popcnt_are_reported():
    x = jnp.arange(8.0)
    assert kinds(audit.audit_function(lambda x: x.at[3].set(1.0), x)) == {"scatter"}
    assert kinds(audit.audit_function(lambda x: (x.astype(jnp.int4) + 1).astype(jnp.int8), x.astype(jnp.int8))) == {
        "int4"
    }
    assert kinds(audit.audit_function(lambda x: (x * 1j).real, x)) == {"complex"}
    assert kinds(audit.audit_function(lax.population_count, jnp.arange(8, dtype=jnp.int32))) == {"bit-count"}


def test_f64_is_reported_under_x64():
    code = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        from jaxkv.eval.audit import audit_function
        assert jnp.arange(2.0).dtype == jnp.float64
        found = audit_function(lambda x: x * 2, jnp.arange(4.0))
        print(len(found), sorted({f.split(': ')[1] for f in found}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr
    count, found = proc.stdout.strip().split(" ", 1)
    assert int(count) > 0 and found == "['f64']"


HAND_WRITTEN = """
module @jit_f {
  func.func public @main(%arg0: tensor<8xf64>, %arg1: tensor<1xui64>, %arg2: tensor<f64>) -> (tensor<8xf64>) {
    %0 = "stablehlo.scatter"(%arg0, %arg1, %arg2) <{indices_are_sorted = true, scatter_dimension_numbers = #stablehlo.scatter<inserted_window_dims = [0], scatter_dims_to_operand_dims = [0]>, unique_indices = true}> ({
    ^bb0(%a: tensor<f64>, %b: tensor<f64>):
      stablehlo.return %b : tensor<f64>
    }) : (tensor<8xf64>, tensor<1xui64>, tensor<f64>) -> tensor<8xf64>
    %1 = stablehlo.count_leading_zeros %arg1 : tensor<1xui64>
    return %0 : tensor<8xf64>
  }
}
"""


def test_hand_written_module():
    found = audit.audit_text(HAND_WRITTEN)
    assert kinds(found) == {"f64", "scatter", "unsigned-index", "bit-count"}
    scatter_line = [f for f in found if "unsigned-index" in f]
    assert len(scatter_line) == 1 and "ui64" in scatter_line[0] and scatter_line[0].startswith("line 4:")
    tame = (
        HAND_WRITTEN.replace("f64", "f32")
        .replace("ui64", "i32")
        .replace("stablehlo.count_leading_zeros", "stablehlo.abs")
    )
    assert kinds(audit.audit_text(tame)) == {"scatter"}  # signed indices, f32: only the scatter itself
    clean = "%0 = stablehlo.dynamic_slice %arg0, %arg1, sizes = [2] : (tensor<8xui8>, tensor<i32>) -> tensor<2xui8>"
    assert audit.audit_text(clean) == []


def test_backend_support_table():
    assert set(audit.backend_support("cpu").values()) == {"supported"}
    assert set(audit.backend_support("gpu").values()) == {"supported"}
    metal = audit.backend_support("METAL")
    assert metal["bf16"].startswith("risky") and all(
        metal[m] == "supported" for m in ("fp32", "fp16", "int8", "int4", "int2")
    )
    assert audit.backend_support("mps") == metal
    assert set(audit.backend_support("weird").values()) == {"unknown"}


def test_info_prints_versions_backend_and_cache_modes(capsys):
    from jaxkv.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"jax {jax.__version__}" in out and "jaxlib" in out and "flax" in out and "chex" in out
    assert "backend cpu; devices:" in out
    assert "cache modes on cpu: fp32 supported, fp16 supported, bf16 supported, int8 supported" in out
    assert "Apple plugins:" in out
