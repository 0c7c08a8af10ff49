"""The numerics-sensitive tests once more under another BLAS code path and one thread (docs/ci.md, "Bits that depend
on the machine").

A float32 ``B[rows] @ A`` gave other bits for each row blocking under ``MKL_CBWR=AVX2`` (on an AMD EPYC by default),
so a LoRA agent's merge depended on the chunk budget and the range merge disagreed with ``ram-trl merge`` there while
the suite was green here. This runs the tests that pin those bits in a fresh interpreter with the MKL AVX2 code path
and one OpenMP thread, so a kernel-dependent product in the merge path fails CI on every machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: The non-default setting: MKL's AVX2 kernels (its blockings differ from the AVX-512 and AMD defaults), one thread.
SETTING = {"MKL_CBWR": "AVX2", "OMP_NUM_THREADS": "1"}

#: Tests whose expected bits must not depend on the BLAS, the thread count or the row blocking.
NUMERICS_TESTS = [
    "tests/io/test_lora_product.py",
    "tests/merging/test_range_merge.py::test_a_lora_prior_and_a_scalar_tensor",
    "tests/merging/test_engine_golden.py",
    "tests/merging/test_engine_reference.py::test_same_result_for_any_chunk_budget_and_shard_size",
    "tests/merging/test_engine_reference.py::test_float32_output_matches_reference_exactly",
]


@pytest.mark.slow
def test_numerics_tests_pass_under_the_mkl_avx2_path_on_one_thread():
    env = {**os.environ, **SETTING}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *NUMERICS_TESTS]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"under {SETTING}:\n{result.stdout[-4000:]}\n{result.stderr[-2000:]}"
    assert " passed" in result.stdout and "deselected" not in result.stdout, result.stdout[-2000:]
