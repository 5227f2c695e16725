"""Quantized matvec / matmul throughput at the bundled model's shapes, against a BLAS baseline.

For each format and (N, K) it prints matvec in G weights/s, matmul of T tokens in tokens/s and
G weights/s, and the baseline "dequantize into a reused float32 buffer, then NumPy BLAS"
(W @ x, X @ W.T), with ratios (> 1 means the quantized kernel is faster). Times are medians of
runs measured side by side in one process, spread over several passes so that load from other
processes spreads too; --stat min approximates an idle machine. The baseline is not batch
invariant; it is only a yardstick. Holds no assertions; tests/quant checks correctness.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numba
import numpy as np

from cfr_atlas.quant import QType, QuantWeight, q4_1, q8_0

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
BLOCK_DTYPES = {QType.Q4_1: q4_1.BLOCK, QType.Q8_0: q8_0.BLOCK}


def random_weight(qtype: QType, n: int, k: int, rng: np.random.Generator) -> QuantWeight:
    """Random but realistic blocks (small scales, full-range quants) built directly as bytes."""
    blocks = np.zeros((n, k // 32), dtype=BLOCK_DTYPES[qtype])
    blocks["d"] = rng.uniform(1e-3, 1e-2, blocks.shape).astype(np.float16)
    if "m" in blocks.dtype.names:
        blocks["m"] = (-8 * blocks["d"].astype(np.float32)).astype(np.float16)
    info = np.iinfo(blocks["qs"].dtype)
    blocks["qs"] = rng.integers(info.min, info.max, blocks["qs"].shape, endpoint=True)
    return QuantWeight.from_raw(f"{qtype.name} {n}x{k}", qtype, blocks.view(np.uint8), (n, k))


def paired_times(fa, fb, budget: float, min_runs: int = 2, max_runs: int = 1000):
    """Seconds per call of fa and fb, run alternately so load from other processes hits both."""
    ta, tb = [], []
    start = time.perf_counter()
    while len(ta) < max_runs and (len(ta) < min_runs or time.perf_counter() - start < budget):
        for f, ts in ((fa, ta), (fb, tb)):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
    return ta, tb


def warm_up(seconds: float) -> None:
    """Compile the kernels and keep the thread pool busy for a while: on some VMs the first
    second of parallel regions runs far slower than steady state."""
    w = random_weight(QType.Q4_1, 576, 576, np.random.default_rng(0))
    x = np.ones(576, dtype=np.float32)
    random_weight(QType.Q8_0, 32, 576, np.random.default_rng(0)).matvec(x)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        w.matvec(x)


class Case:
    """One weight with its inputs, buffers and the run times collected over all passes."""

    def __init__(self, w: QuantWeight, tokens: int, rng: np.random.Generator):
        n, k = w.shape
        self.w, self.tokens = w, tokens
        self.x = rng.standard_normal(k).astype(np.float32)
        self.X = rng.standard_normal((tokens, k)).astype(np.float32)
        self.y = np.empty(n, dtype=np.float32)
        self.Y = np.empty((tokens, n), dtype=np.float32)
        self.wf = np.empty((n, k), dtype=np.float32)  # the baseline's reused buffer
        self.times = {"mv": [], "mv_blas": [], "mm": [], "mm_blas": []}

    def blas_mv(self):
        self.w.dequantize(out=self.wf)
        np.dot(self.wf, self.x, out=self.y)

    def blas_mm(self):
        self.w.dequantize(out=self.wf)
        np.dot(self.X, self.wf.T, out=self.Y)

    def run(self, budget: float) -> None:
        t = self.times
        a, b = paired_times(lambda: self.w.matvec(self.x, out=self.y), self.blas_mv, budget)
        t["mv"] += a
        t["mv_blas"] += b
        a, b = paired_times(lambda: self.w.matmul(self.X, out=self.Y), self.blas_mm, budget)
        t["mm"] += a
        t["mm_blas"] += b

    def row(self, stat) -> str:
        n, k = self.w.shape
        med = {key: stat(v) for key, v in self.times.items()}
        mv, mv_b = n * k / med["mv"] / 1e9, n * k / med["mv_blas"] / 1e9
        tok, tok_b = self.tokens / med["mm"], self.tokens / med["mm_blas"]
        runs = min(len(v) for v in self.times.values())
        return (f"{self.w.qtype.name:6} {f'{n}x{k}':>11} | {mv:7.1f} {mv_b:6.1f} {mv / mv_b:5.1f} "
                f"| {tok:7.0f} {tok * n * k / 1e9:6.1f} {tok_b:7.0f} {tok_b * n * k / 1e9:6.1f} "
                f"{tok / tok_b:5.2f} | {runs}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="Q4_1,Q8_0", help="comma-separated (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=256, help="T for matmul (default: %(default)s)")
    p.add_argument("--budget", type=float, default=1.0,
                   help="seconds per measurement pair, summed over passes (default: %(default)s)")
    p.add_argument("--passes", type=int, default=6,
                   help="rounds over all cases, at least 2 runs each (default: %(default)s)")
    p.add_argument("--stat", choices=["median", "min"], default="median",
                   help="per-call time statistic; min estimates an otherwise idle machine "
                        "(default: %(default)s)")
    p.add_argument("--threads", type=int, default=numba.get_num_threads(),
                   help="numba threads (default: %(default)s)")
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES),
                   help="comma-separated NxK (default: the bundled model's shapes)")
    args = p.parse_args(argv)
    numba.set_num_threads(args.threads)
    formats = [QType[f.strip()] for f in args.formats.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    stat = {"median": statistics.median, "min": min}[args.stat]
    rng = np.random.default_rng(0)

    cases = [Case(random_weight(qtype, n, k, rng), args.tokens, rng)
             for qtype in formats for n, k in shapes]
    warm_up(1.5)
    load = os.getloadavg()[0]
    for _ in range(args.passes):  # spread each case's runs over the whole benchmark
        for case in cases:
            case.run(args.budget / args.passes)
    print(f"numba threads {args.threads}, matmul T={args.tokens}, {args.stat} time per call over "
          f"{args.passes} passes; load average {load:.2f} at the start")
    head = (f"{'format':6} {'N x K':>11} | {'matvec':>7} {'blas':>6} {'ratio':>5} | "
            f"{'matmul':>7} {'':>6} {'blas':>7} {'':>6} {'ratio':>5} | runs")
    units = (f"{'':6} {'':>11} | {'Gw/s':>7} {'Gw/s':>6} {'':>5} | "
             f"{'tok/s':>7} {'Gw/s':>6} {'tok/s':>7} {'Gw/s':>6} {'':>5} |")
    print(head, units, "-" * len(head), *(case.row(stat) for case in cases), sep="\n")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
