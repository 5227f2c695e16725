"""The integer tile kernel's two builds side by side: sums in registers against sums in memory.

    python benchmarks/bench_tile_kernels.py [--formats Q4_0,Q8_0,Q4_1,Q6_K]
        [--shapes 65536x1536,1536x1536] [--tokens 1,2,4,8,64,512] [--pairs 11] [--isa best]
        [--rows 8|16]

For each format, matrix shape and token count, one process builds both kernels of
`int8.tile_kernel` (in_registers=True and False, the same instruction set) on the same
random weights (bench_matmul.random_weight) and the same quantized activations, checks that
they give bitwise the same output, then times them in --pairs alternating pairs (each a
batch of calls of about 3 M weight-token products). A row prints both medians and the median
of the pairs' ratios registers / memory (< 1: the register kernel is faster), so the
machine's minute cancels. A matrix larger than the last-level cache (65,536 x 1,536) streams
its weights from memory on every call; a small one (1,536 x 1,536) stays in cache.
--isa picks the dots: best (int8.ISA), avx2, vnni or portable; the default build of a
machine (`int8.registers_for`) is printed. --rows picks the register kernel's weight rows a
vector (default: the machine's, `int8.pass_rows`: 16 where int8.WIDE, so `--rows 8` times the
8-row register kernel there). Holds no assertions beyond the bitwise check;
tests/quant checks correctness.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numba
import numpy as np

from bench_matmul import random_weight
from cfr_atlas.quant import QType, int8, int8_sub16

ISAS = {"best": int8.ISA, "avx2": int8.AVX2_DOT, "vnni": int8.VNNI_DOT,
        "portable": int8.PORTABLE}
TERMS = {QType.Q4_0: (4, int8.OFFSET8), QType.Q4_1: (4, int8.MIN), QType.Q8_0: (8, int8.SCALE)}
SUB16 = (QType.Q6_K, QType.Q3_K)


def kernels(qtype: QType, isa: int, rows: int | None = None) -> tuple:
    """(memory kernel, register kernel) of qtype's integer path; rows: the register kernel's
    weight rows a vector (None: the machine's default, `int8.pass_rows`; Q6_K / Q3_K take 8)."""
    if qtype in SUB16:
        return tuple(int8_sub16.tile_kernel(isa=isa, in_registers=r) for r in (False, True))
    bits, term = TERMS[qtype]
    return (int8.tile_kernel(bits, term, isa=isa, in_registers=False),
            int8.tile_kernel(bits, term, isa=isa, in_registers=True, rows=rows))


def arguments(qtype: QType, tiles) -> tuple:
    """The kernel's weight arguments (q, d, m) for qtype's tiles."""
    if qtype in SUB16:
        return tiles.q, tiles.d, tiles.s
    return tiles.q, tiles.d, getattr(tiles, "m", tiles.d)


def row(qtype: QType, n: int, k: int, tokens: int, isa: int, pairs: int,
        rng: np.random.Generator, weight, rows: int | None = None) -> dict:
    memory, registers = kernels(qtype, isa, rows)
    q, d, m = arguments(qtype, weight.tiles)
    xq, xd, xsum = int8.quantize(rng.standard_normal((tokens, k)).astype(np.float32))
    a, b = (np.empty((tokens, n), dtype=np.float32) for _ in range(2))
    memory(xq, xd, xsum, q, d, m, a)
    registers(xq, xd, xsum, q, d, m, b)
    if not np.array_equal(a, b):
        raise AssertionError(f"{qtype.name} {n}x{k} x {tokens}: the kernels' bits differ")
    reps = max(1, int(3e9 // (n * k * tokens)))
    times = {"memory": [], "registers": []}
    for _ in range(pairs):
        for name, kernel, out in (("memory", memory, a), ("registers", registers, b)):
            t0 = time.perf_counter()
            for _ in range(reps):
                kernel(xq, xd, xsum, q, d, m, out)
            times[name].append((time.perf_counter() - t0) / reps)
    ratios = [reg / mem for mem, reg in zip(times["memory"], times["registers"], strict=True)]
    return {"format": qtype.name, "shape": f"{n}x{k}", "tokens": tokens,
            "memory_ms": 1e3 * statistics.median(times["memory"]),
            "registers_ms": 1e3 * statistics.median(times["registers"]),
            "ratio": statistics.median(ratios), "low": min(ratios), "high": max(ratios)}


def _shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        n, k = (int(v) for v in part.lower().split("x"))
        if n < 1 or k < 256 or k % 256:
            raise ValueError(part)
        out.append((n, k))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", default="Q4_0,Q8_0,Q4_1,Q6_K",
                   help="comma-separated: Q4_0, Q4_1, Q8_0, Q6_K, Q3_K (default: %(default)s)")
    p.add_argument("--shapes", default="65536x1536,1536x1536",
                   help="NxK matrices, K a multiple of 256 (default: %(default)s)")
    p.add_argument("--tokens", default="1,2,4,8,64,512", help="token counts (default: %(default)s)")
    p.add_argument("--pairs", type=int, default=11, help="alternating pairs (default: 11)")
    p.add_argument("--isa", default="best", choices=list(ISAS))
    p.add_argument("--threads", type=int, default=numba.get_num_threads())
    p.add_argument("--rows", type=int, choices=(int8.GROUP, int8.WIDE_ROWS), default=None,
                   help="the register kernel's weight rows a vector (default: the machine's; "
                        "16 needs AVX-512 BW and VNNI)")
    args = p.parse_args(argv)
    try:
        formats = [QType[f] for f in args.formats.split(",")]
        if any(f not in TERMS and f not in SUB16 for f in formats):
            raise KeyError(args.formats)
        shapes = _shapes(args.shapes)
        tokens = [int(t) for t in args.tokens.split(",")]
        threads_ok = 1 <= args.threads <= numba.config.NUMBA_NUM_THREADS
        if min(tokens) < 1 or args.pairs < 1 or not threads_ok:
            raise ValueError("tokens, pairs or threads")
        isa = ISAS[args.isa]
        if isa not in int8.ISAS:
            raise ValueError(f"--isa {args.isa} does not run on this machine")
        if args.rows == int8.WIDE_ROWS and not (int8.WIDE and isa == int8.VNNI_DOT):
            raise ValueError("--rows 16 needs vnni dots on a target with AVX-512 BW")
    except (KeyError, ValueError) as exc:
        print(f"bench_tile_kernels: bad argument ({exc}): formats from Q4_0, Q4_1, Q8_0, Q6_K, "
              "Q3_K; shapes NxK with K a multiple of 256; tokens, pairs and threads >= 1",
              file=sys.stderr)
        return 2
    numba.set_num_threads(args.threads)
    default = (f"registers, {int8.pass_rows(4, int8.ISA)} rows a vector"
               if int8.registers_for(int8.ISA) else "memory")
    print(f"tile kernels, {args.threads} threads, dots {args.isa}; this machine's default: "
          f"{default}; register kernel timed: {args.rows or 'default'} rows a vector")
    print("| format | matrix | tokens | memory ms | registers ms | registers / memory "
          "(median of pairs) | pairs' range |")
    print("|---|---|---:|---:|---:|---:|---|")
    rng = np.random.default_rng(0)
    for qtype in formats:
        for n, k in shapes:
            weight = random_weight(qtype, n, k, rng, arithmetic="int8")
            for t in tokens:
                r = row(qtype, n, k, t, isa, args.pairs, rng, weight, args.rows)
                print(f"| {r['format']} | {r['shape']} | {t} | {r['memory_ms']:.3f} | "
                      f"{r['registers_ms']:.3f} | {r['ratio']:.2f} | {r['low']:.2f}-"
                      f"{r['high']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
