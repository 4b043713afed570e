"""The reference tiled attention's memory grows linearly in S (kernels disabled).

Forward + backward of one causal head (B = H = 1, D_h = 64, float64, tiles of 128) keeps
the output, lse, Delta and the three gradients: (4 D_h + 2) * 8 bytes per position, about
2 KiB, plus a few [128, 128] tiles that do not grow with S. An [S, S] table anywhere (the
whole causal table sliced per diagonal tile, say) adds 8 S^2 bytes: 32 MiB at S = 2048,
16 times the linear part.
"""
from __future__ import annotations

import tracemalloc

import numpy as np

from tfcore import functional as F
from tfcore import kernels

D_H, BLOCK = 64, 128
SIZES = (512, 1024, 2048)


def _peak_bytes(s: int, rng) -> int:
    """Traced peak of the reference op's forward + backward, beyond what was held before."""
    q, k, v, g = (rng.standard_normal((1, 1, s, D_H)) for _ in range(4))
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        out, cache = F.tiled_attention_forward(q, k, v, causal=True, block_size=BLOCK)
        grads = F.tiled_attention_backward(g, cache)
        del out, cache, grads
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_reference_tiled_attention_memory_is_linear_in_s():
    rng = np.random.default_rng(0)
    with kernels.disabled():
        _peak_bytes(SIZES[0], rng)        # a first call allocates once-only buffers: not ours
        peaks = [_peak_bytes(s, rng) for s in SIZES]
    per_position = (4 * D_H + 2) * 8      # out, dq, dk, dv [S, D_h]; lse, Delta [S]
    tiles = 16 * BLOCK * BLOCK * 8        # generous: 16 [BLOCK, BLOCK] float64 tiles, 2 MiB
    report = ", ".join(f"S={s}: {p / 2**20:.2f} MiB" for s, p in zip(SIZES, peaks))
    for s, peak in zip(SIZES, peaks):
        # what must be held, and at most that plus tiles that do not grow with S
        assert per_position * s <= peak <= per_position * s + tiles, report
    # doubling S: a + b S at most doubles the peak; a quadratic term makes it nearly 4 times
    for small, large in zip(peaks, peaks[1:]):
        assert large / small < 2.2, report
    # the increments of a + b S double exactly with S; those of c S^2 quadruple. A ratio
    # below 2.5 bounds the quadratic part of the peak at S to a ninth of the linear part.
    ratio = (peaks[2] - peaks[1]) / (peaks[1] - peaks[0])
    assert 1.5 < ratio < 2.5, (ratio, report)
