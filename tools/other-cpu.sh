#!/usr/bin/env bash
# Prints the environment variables that make NumPy, OpenBLAS and Numba run the code paths of
# another x86-64 generation than this machine's, for checking that no compared output
# depends on last-bit rounding (.ci/run, and by hand: `env $(bash tools/other-cpu.sh) ...`).
#   AVX-512 machine -> an AVX2 (Haswell) machine: NumPy's AVX-512 loops off, OpenBLAS's
#                      Haswell kernels, Numba compiled for Haswell.
#   otherwise       -> an SSE4.2 (Nehalem) machine: NumPy's AVX2/AVX-512 loops off (X86_V3
#                      and up), OpenBLAS's Nehalem kernels, Numba compiled for Nehalem.
set -euo pipefail
if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
    echo 'NPY_DISABLE_CPU_FEATURES=X86_V4,AVX512_ICL,AVX512_SPR OPENBLAS_CORETYPE=Haswell NUMBA_CPU_NAME=haswell'
else
    echo 'NPY_DISABLE_CPU_FEATURES=X86_V3,X86_V4,AVX512_ICL,AVX512_SPR OPENBLAS_CORETYPE=Nehalem NUMBA_CPU_NAME=nehalem'
fi
