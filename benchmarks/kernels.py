"""Kernel benchmark: top-k selection and quantizer throughput against their baselines.

Measures, in one run and on the same input (n float32, k = ceil(density * n)):
  * jaxcomm.ops.topk_abs vs lax.top_k(jnp.abs(x), k) vs NumPy argpartition;
  * jaxcomm.ops.compress for each compressor (with error feedback) vs a plain memory copy of
    the same bytes (NumPy copyto), as GB/s of x read;
  * BlockQuant's quantize + dequantize (compress, then decompress) against the same copy.

Prints a table, writes JSON (default benchmarks/results/kernels.json) and a PNG beside it.

Usage:
  python benchmarks/kernels.py                      # n = 25M, density = 0.001, 7 repeats
  python benchmarks/kernels.py --n 1000000 --repeats 5 --out /tmp/k.json
  python benchmarks/kernels.py --device gpu         # CUDA kernels vs lax.top_k on the GPU,
                                                    # quantizers vs a device-to-device copy
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomm

# .ci/gpu-check runs this file with `python -P` (so that the installed jaxcomm is imported, not
# the source tree), which leaves this directory off sys.path.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _bench import add_repeats_argument, pyplot, save_plot  # noqa: E402


def median_seconds(
    fn: Callable[[], object], repeats: int, calls: int = 1
) -> tuple[float, list[float]]:
    """Median seconds per call of `fn` over `repeats` samples of `calls` back-to-back calls.

    Each sample dispatches `calls` calls without waiting (JAX's async dispatch, as a training
    loop runs) and then blocks on the last. On a GPU, blocking after every call would time the
    launch and the host round trip (about 0.1 ms here) rather than the kernel.
    """
    jax.block_until_ready(fn())  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls - 1):
            fn()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times), times


def select_device(parser: argparse.ArgumentParser, kind: str) -> jax.Device:
    """The device to benchmark on; a clear error when --device gpu cannot run here."""
    if kind == "cpu":
        return jax.devices("cpu")[0]
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as error:
        parser.error(
            f"--device gpu: no GPU visible to JAX ({error}); run on a CUDA machine "
            "with jax[cuda] installed, or use --device cpu"
        )
    from jaxcomm import _ffi

    if not _ffi.has_gpu_kernels():
        parser.error(
            "--device gpu: jaxcomm was built without its CUDA kernels; reinstall with "
            "JAXCOMM_ENABLE_CUDA=ON python -m pip install ."
        )
    return gpus[0]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=25_000_000)
    parser.add_argument("--density", type=float, default=0.001)
    add_repeats_argument(parser, 7)
    parser.add_argument(
        "--calls",
        type=int,
        default=None,
        help="back-to-back calls per timed sample (default: 1 on cpu, 20 on gpu)",
    )
    parser.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/kernels.json")
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "gpu"],
        default="cpu",
        help="where x lives and the kernels run (gpu needs a CUDA build)",
    )
    args = parser.parse_args()
    args.device_obj = select_device(parser, args.device)
    args.calls = args.calls or (20 if args.device == "gpu" else 1)
    return args


class Recorder:
    """Times kernels over ``n`` floats and keeps one row per kernel."""

    def __init__(self, n: int, repeats: int, calls: int) -> None:
        self.n, self.repeats, self.calls = n, repeats, calls
        self.rows: list[dict] = []

    def record(
        self, group: str, name: str, fn: Callable[[], object], baseline: str | None = None
    ) -> None:
        n = self.n
        median, times = median_seconds(fn, self.repeats, self.calls)
        self.rows.append(
            {
                "group": group,
                "name": name,
                "median_s": median,
                "times_s": times,
                "gbps": 4 * n / median / 1e9,
                "baseline": baseline,
            }
        )
        print(
            f"  {group:10s} {name:34s} {median * 1e3:9.2f} ms  {4 * n / median / 1e9:7.2f} GB/s",
            flush=True,
        )


def time_topk_and_copy(rec: Recorder, x: jax.Array, x_np: np.ndarray, k: int, gpu: bool) -> None:
    """jaxcomm's top-k against lax's (and NumPy's on CPU), and the copy baseline."""
    n = rec.n
    topk_jaxcomm = jax.jit(jaxcomm.ops.topk_abs, static_argnums=1)
    topk_lax = jax.jit(lambda v: jax.lax.top_k(jnp.abs(v), k))
    rec.record("topk", "jaxcomm.ops.topk_abs", lambda: topk_jaxcomm(x, k))
    rec.record("topk", "lax.top_k(jnp.abs(x), k)", lambda: topk_lax(x), baseline="lax")
    if not gpu:
        rec.record(
            "topk",
            "numpy argpartition",
            lambda: np.argpartition(np.abs(x_np), n - k)[n - k :],
            baseline="numpy",
        )
        copy_dst = np.empty_like(x_np)
        rec.record(
            "quantize", "memcpy (np.copyto)", lambda: np.copyto(copy_dst, x_np), baseline="copy"
        )
    else:  # device memory bandwidth: a device-to-device copy of x (reads n, writes n floats)
        device_copy = jax.jit(jnp.copy)
        rec.record("quantize", "device copy (jnp.copy)", lambda: device_copy(x), baseline="copy")


def time_compressors(rec: Recorder, x: jax.Array, density: float) -> None:
    """Every compressor's compress, and block quantization's compress + decompress."""
    compressors = [
        jaxcomm.TopK(density),
        jaxcomm.OneBit(),
        jaxcomm.OneBit(sample_size=64),
        jaxcomm.Threshold(2.5),
        jaxcomm.Adaptive(64),
        jaxcomm.Adaptive(64, sample_size=256),
        jaxcomm.BlockQuant(bits=8),
        jaxcomm.BlockQuant(bits=4),
    ]
    # The residual is donated and carried from call to call, as a training step does: the
    # kernel then updates it in place instead of XLA copying 4n bytes first.
    compress = jax.jit(jaxcomm.ops.compress, static_argnums=2, donate_argnums=1)
    for c in compressors:
        state = {"residual": jnp.zeros_like(x)}

        def step(c=c, state=state):
            packed, state["residual"] = compress(x, state["residual"], c)
            return packed

        rec.record("quantize", f"compress {c}", step)

    # Block quantization's whole local work in a quantized allreduce, per element: quantize
    # with error feedback, then dequantize (issue 25's target: >= 50 % of copy bandwidth).
    decompress = jax.jit(jaxcomm.ops.decompress, static_argnums=(1, 2))
    for c in (jaxcomm.BlockQuant(bits=8), jaxcomm.BlockQuant(bits=4)):
        state = {"residual": jnp.zeros_like(x)}

        def roundtrip(c=c, state=state):
            packed, state["residual"] = compress(x, state["residual"], c)
            return decompress(packed, c, rec.n)

        rec.record("quantize", f"compress + decompress {c}", roundtrip)


def summarize(rows: list[dict]) -> dict:
    """Top-k's speedup over lax, each quantizer's fraction of copy bandwidth; prints the table."""
    lax_row = next(r for r in rows if r["baseline"] == "lax")
    ours = next(r for r in rows if r["name"] == "jaxcomm.ops.topk_abs")
    copy_row = next(r for r in rows if r["baseline"] == "copy")
    summary = {
        "topk_speedup_vs_lax": lax_row["median_s"] / ours["median_s"],
        "quantizer_fraction_of_copy_bandwidth": {
            r["name"]: r["gbps"] / copy_row["gbps"]
            for r in rows
            if r["name"].startswith("compress") or r["name"].startswith("decompress")
        },
    }
    print()
    print(f"{'kernel':44s} {'median ms':>10s} {'GB/s':>8s} {'vs baseline':>12s}")
    for r in rows:
        if r["group"] == "topk":
            rel = f"{lax_row['median_s'] / r['median_s']:.1f}x lax"
        else:
            rel = f"{r['gbps'] / copy_row['gbps']:.2f} of copy"
        print(f"{r['name']:44s} {r['median_s'] * 1e3:10.2f} {r['gbps']:8.2f} {rel:>12s}")
    return summary


def plot(out: pathlib.Path, rows: list[dict], title: str) -> pathlib.Path | None:
    """The bar chart beside ``out`` (None without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return None
    png = out.with_suffix(".png")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for is_baseline, color, label in [(False, "C0", "jaxcomm"), (True, "0.6", "baseline")]:
        chosen = [r for r in rows if bool(r["baseline"]) == is_baseline]
        ax.barh([r["name"] for r in chosen], [r["gbps"] for r in chosen], color=color, label=label)
    ax.invert_yaxis()
    save_plot(fig, ax, png, xlabel="GB/s of x read (higher is better)", ylabel="", title=title)
    return png


def main() -> None:
    args = parse_args()
    device, calls = args.device_obj, args.calls
    n, k = args.n, max(1, int(np.ceil(args.density * args.n)))
    x_np = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    x = jax.device_put(x_np, device)
    rec = Recorder(n, args.repeats, calls)
    print(f"n = {n}, k = {k}, repeats = {args.repeats} x {calls} calls, device = {device}")
    time_topk_and_copy(rec, x, x_np, k, gpu=args.device == "gpu")
    time_compressors(rec, x, args.density)
    rows = rec.rows
    summary = summarize(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "n": n,
                "k": k,
                "density": args.density,
                "repeats": args.repeats,
                "calls_per_sample": calls,
                "machine": {
                    "cpus": os.cpu_count(),
                    # the cores this run may use (1 under `taskset -c 1`: issue 25's one core)
                    "cores_used": len(os.sched_getaffinity(0)),
                    "platform": platform.platform(),
                },
                "jax": jax.__version__,
                "device": str(device),
                "rows": rows,
                "summary": summary,
            },
            indent=2,
        )
    )
    png = plot(args.out, rows, f"{device}: n = {n}, k = {k}")
    print(f"\nwrote {args.out} and {png}" if png else f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
