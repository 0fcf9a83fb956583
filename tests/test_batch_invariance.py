"""Batch invariance at the kernel level: with batch_invariant=True a row's matmul result is
bit-identical whatever rows share the call, so a request decodes the same tokens alone, batched
with others, or recomputed after preemption."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.backends.cpu.matmul import QuantMatrix, matmul
from edgeinfer.backends.cpu.quants import SUPPORTED_TYPES, random_quant_rows


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_row_results_do_not_depend_on_batch(qtype):
    rng = np.random.default_rng(int(qtype))
    K, N = 512, 40
    w = QuantMatrix.from_bytes(random_quant_rows(qtype, N, K, rng), qtype, K, N)
    x = rng.standard_normal((11, K)).astype(np.float32)
    alone = np.stack([matmul(x[i:i + 1], w, batch_invariant=True)[0] for i in range(11)])
    for m in (2, 3, 4, 5, 8, 11):
        together = matmul(x[:m], w, batch_invariant=True)
        assert np.array_equal(together, alone[:m]), f"M={m}"
    # rows in a different order and company: still the same bits
    perm = rng.permutation(11)
    assert np.array_equal(matmul(x[perm], w, batch_invariant=True), alone[perm])


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_few_rows_equal_single_row_matvec(qtype):
    """The default path: a few rows (batched decode of a few streams) give each row exactly
    the single-row matvec's result."""
    from edgeinfer.backends.cpu.matmul import FEW_ROWS
    rng = np.random.default_rng(7 + int(qtype))
    K, N = 512, 40
    w = QuantMatrix.from_bytes(random_quant_rows(qtype, N, K, rng), qtype, K, N)
    x = rng.standard_normal((FEW_ROWS, K)).astype(np.float32)
    alone = np.stack([matmul(x[i], w) for i in range(FEW_ROWS)])
    for m in range(2, FEW_ROWS + 1):
        assert np.array_equal(matmul(x[:m], w), alone[:m]), f"M={m}"
