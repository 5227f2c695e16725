"""Quantized matvec / matmul throughput at real model shapes, against a BLAS baseline.

For each format, matmul arithmetic (--matmul: float, int8) and (N, K) it prints matvec in
G weights/s and GB/s of weight bytes as the GGUF file stores them (block bytes / block elements:
0.5625 per weight for Q4_K, 0.625 for Q4_1), matmul of T tokens in tokens/s and G weights/s, and
the baseline "dequantize into a reused float32 buffer, then NumPy BLAS" (W @ x, X @ W.T), with
ratios (> 1 means the quantized kernel is faster). The baseline is not batch invariant; it is
only a yardstick. --shapes qwen and --shapes gemma give the Qwen2.5-0.5B and Gemma 3 270M matrix
shapes. Formats without an integer path run their float kernel under --matmul int8.

Method: calls run in batches of at least --batch seconds; a batch's time per call is its mean.
Kernel and baseline batches alternate, each after --settle untimed seconds so that the other
thread pool (numba's or OpenBLAS's, both spin-wait after work) has gone quiet, and each case's
batches are spread over several passes. The baseline uses NumPy's BLAS threads as configured
(OPENBLAS_NUM_THREADS), not --threads.
On a shared machine a batch during which other processes used more than --max-foreign of the
CPUs (from /proc/stat minus this process's own CPU time) is set aside; the table reports the
median over the clean batches (all batches if fewer than two are clean) and how many were clean.
Holds no assertions; tests/quant checks correctness.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numba
import numpy as np

from cfr_atlas.quant import BLOCKS, QType, QuantWeight, kquants, q4_0, q4_1, q5, q8_0

SHAPES = {
    "bundled": [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)],
    "qwen": [(896, 896), (128, 896), (4864, 896), (896, 4864)],  # Qwen2.5-0.5B
    "gemma": [(1024, 640), (640, 1024), (2048, 640), (640, 2048)],  # Gemma 3 270M
}
BLOCK_DTYPES = {QType.Q4_0: q4_0.BLOCK, QType.Q4_1: q4_1.BLOCK, QType.Q8_0: q8_0.BLOCK,
                **q5.BLOCK_DTYPES, **kquants.BLOCK_DTYPES}
TICK = os.sysconf("SC_CLK_TCK")


def random_weight(qtype: QType, n: int, k: int, rng: np.random.Generator,
                  arithmetic: str = "float") -> QuantWeight:
    """Random but realistic blocks (small f16 scales, full-range quants and packed scales) built
    directly as bytes; Q4_1's minimum is -8 d."""
    dtype = BLOCK_DTYPES[qtype]
    raw = rng.integers(0, 256, (n, k // BLOCKS[qtype].elements * dtype.itemsize), dtype=np.uint8)
    blocks = raw.view(dtype)
    for field in (f for f in dtype.names if dtype[f] == np.dtype("<f2")):
        blocks[field] = rng.uniform(1e-3, 1e-2, blocks.shape).astype(np.float16)
    if "m" in dtype.names:
        blocks["m"] = (-8 * blocks["d"].astype(np.float32)).astype(np.float16)
    return QuantWeight.from_raw(f"{qtype.name} {n}x{k}", qtype, raw, (n, k),
                                arithmetic=arithmetic)


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds all processes have run, CPU seconds this process has run); the first is NaN
    where /proc/stat is missing, which marks every batch clean."""
    t = os.times()
    try:
        with open("/proc/stat") as f:
            v = [int(s) for s in f.readline().split()[1:]]
        busy = (sum(v) - v[3] - v[4]) / TICK  # minus idle and iowait
    except OSError:
        busy = float("nan")
    return busy, t.user + t.system


def batch(f, seconds: float, settle: float) -> tuple[float, float]:
    """Run f untimed for `settle` seconds (the other thread pool, numba's or BLAS's, stops
    spin-waiting), then for at least `seconds` -> (seconds per call, share of all CPUs used
    by other processes)."""
    end = time.perf_counter() + settle
    while time.perf_counter() < end:
        f()
    busy0, own0 = cpu_seconds()
    t0 = time.perf_counter()
    calls = 0
    while calls == 0 or time.perf_counter() - t0 < seconds:
        f()
        calls += 1
    wall = time.perf_counter() - t0
    busy1, own1 = cpu_seconds()
    foreign = ((busy1 - busy0) - (own1 - own0)) / (wall * os.cpu_count())
    return wall / calls, foreign


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
    """One weight with its inputs, buffers and the batches collected over all passes."""

    def __init__(self, w: QuantWeight, tokens: int, rng: np.random.Generator, arithmetic: str):
        n, k = w.shape
        self.w, self.tokens, self.arithmetic = w, tokens, arithmetic
        self.x = rng.standard_normal(k).astype(np.float32)
        self.X = rng.standard_normal((tokens, k)).astype(np.float32)
        self.y = np.empty(n, dtype=np.float32)
        self.Y = np.empty((tokens, n), dtype=np.float32)
        self.wf = np.empty((n, k), dtype=np.float32)  # the baseline's reused buffer
        self.calls = {
            "mv": lambda: self.w.matvec(self.x, out=self.y),
            "mv_blas": self.blas_mv,
            "mm": lambda: self.w.matmul(self.X, out=self.Y),
            "mm_blas": self.blas_mm,
        }
        self.batches: dict[str, list[tuple[float, float]]] = {key: [] for key in self.calls}

    def blas_mv(self):
        self.w.dequantize(out=self.wf)
        np.dot(self.wf, self.x, out=self.y)

    def blas_mm(self):
        self.w.dequantize(out=self.wf)
        np.dot(self.X, self.wf.T, out=self.Y)

    def run(self, seconds: float, settle: float) -> None:
        """One batch of each call, kernel and baseline alternating."""
        for key, f in self.calls.items():
            self.batches[key].append(batch(f, seconds, settle))

    def seconds(self, key: str, max_foreign: float) -> tuple[float, int]:
        """Median seconds per call over clean batches (all if < 2 are clean), and clean count."""
        runs = self.batches[key]
        clean = [t for t, foreign in runs if not foreign > max_foreign]
        return statistics.median(clean if len(clean) >= 2 else [t for t, _ in runs]), len(clean)

    def row(self, max_foreign: float) -> str:
        n, k = self.w.shape
        (mv, c1), (mv_b, c2), (mm, c3), (mm_b, c4) = (
            self.seconds(key, max_foreign) for key in self.calls)
        gw, gw_b = n * k / mv / 1e9, n * k / mv_b / 1e9
        gb = gw * BLOCKS[self.w.qtype].bytes / BLOCKS[self.w.qtype].elements
        tok, tok_b = self.tokens / mm, self.tokens / mm_b
        clean = f"{min(c1, c2, c3, c4)}/{len(self.batches['mv'])}"
        return (f"{self.w.qtype.name:6} {self.arithmetic:5} {f'{n}x{k}':>11} | {gw:7.1f} "
                f"{gb:6.2f} {gw_b:6.1f} {gw / gw_b:5.1f} "
                f"| {tok:7.0f} {tok * n * k / 1e9:6.1f} {tok_b:7.0f} {tok_b * n * k / 1e9:6.1f} "
                f"{tok / tok_b:5.2f} | {clean:>5}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--formats", default="Q4_1,Q8_0", help="comma-separated (default: %(default)s)")
    p.add_argument("--shapes", default="bundled",
                   help=f"comma-separated NxK or names of shape sets ({', '.join(SHAPES)}); "
                        "a format skips shapes whose K splits its block (default: %(default)s)")
    p.add_argument("--matmul", default="float,int8",
                   help="comma-separated arithmetics (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=256, help="T for matmul (default: %(default)s)")
    p.add_argument("--passes", type=int, default=4,
                   help="batches per call and case, one per pass (default: %(default)s)")
    p.add_argument("--batch", type=float, default=0.15,
                   help="minimum seconds per batch (default: %(default)s)")
    p.add_argument("--settle", type=float, default=0.1,
                   help="untimed seconds before each batch (default: %(default)s)")
    p.add_argument("--max-foreign", type=float, default=0.1,
                   help="CPU share other processes may use during a clean batch "
                        "(default: %(default)s)")
    p.add_argument("--threads", type=int, default=numba.get_num_threads(),
                   help="numba threads (default: %(default)s)")
    args = p.parse_args(argv)
    numba.set_num_threads(args.threads)
    formats = [QType[f.strip()] for f in args.formats.split(",")]
    shapes = [shape for s in args.shapes.split(",") for shape in
              (SHAPES[s] if s in SHAPES else [tuple(int(v) for v in s.split("x"))])]
    rng = np.random.default_rng(0)

    arithmetics = [a.strip() for a in args.matmul.split(",")]
    cases = [Case(random_weight(qtype, n, k, np.random.default_rng(n * k), a), args.tokens, rng, a)
             for qtype in formats for n, k in shapes for a in arithmetics
             if k % BLOCKS[qtype].elements == 0]
    warm_up(1.5)
    for _ in range(args.passes):  # spread each case's batches over the whole benchmark
        for case in cases:
            case.run(args.batch, args.settle)
    print(f"numba threads {args.threads}, matmul T={args.tokens}, median of batch means; "
          f"clean = batches with other processes under {args.max_foreign:.0%} of the CPUs")
    head = (f"{'format':6} {'arith':5} {'N x K':>11} | {'matvec':>7} {'':>6} {'blas':>6} "
            f"{'ratio':>5} | {'matmul':>7} {'':>6} {'blas':>7} {'':>6} {'ratio':>5} | clean")
    units = (f"{'':6} {'':5} {'':>11} | {'Gw/s':>7} {'GB/s':>6} {'Gw/s':>6} {'':>5} | "
             f"{'tok/s':>7} {'Gw/s':>6} {'tok/s':>7} {'Gw/s':>6} {'':>5} |")
    print(head, units, "-" * len(head), *(case.row(args.max_foreign) for case in cases),
          sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
