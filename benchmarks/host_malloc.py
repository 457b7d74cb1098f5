"""Page faults of launched ranks with glibc's own malloc thresholds and with freed memory kept.

Runs one end-to-end cell (``benchmarks/train.py``, one seed) again and again, alternating
``JAXCOMM_HOST_MALLOC=system`` and ``keep`` (``jaxcomm_launcher/hostmem.py``) run by run,
while a sampler reads each rank's minor page faults and kernel time from ``/proc`` every
second. A rank whose step buffers glibc unmaps at every free faults them in again on every
step; the table counts the runs where a rank did, and their step times.

Usage (root, for the emulated links; resumable: finished runs are kept in the JSON):
  python benchmarks/host_malloc.py --workload heldout-fivemom --network 100mbit \\
      --algorithms topk_allgather auto-bf16 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _bench import write_result_and_plot  # noqa: E402
from jaxcomm_launcher.procs import descendants  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
SETTINGS = ("system", "keep")
FAULTING = 10_000
"""Minor faults a second, in steady state, above which a rank counts as faulting."""
TICKS = os.sysconf("SC_CLK_TCK")


def _ranks(root: int) -> dict[str, tuple[int, int]]:
    """Each running rank below ``root`` (this run's train.py): its pid's (minor faults,
    kernel ticks)."""
    found = {}
    for pid in map(str, descendants(root)):
        try:
            cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"jaxcomm_launcher.worker" not in cmd:
                continue
            fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[pid] = (int(fields[7]), int(fields[12]))
    return found


class Sampler(threading.Thread):
    """Samples :func:`_ranks` every second until stopped."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.samples: list[tuple[float, dict[str, tuple[int, int]]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.samples.append((time.monotonic(), _ranks(self.root)))

    def rates(self) -> list[dict[str, float]]:
        """Each rank of the last launch (the cell's; train.py may launch others to measure
        first): its median faults and kernel share a second over its last 20 samples
        (training; its start is compilation and measuring)."""
        # The last 10 samples with ranks: one rank may exit a sample before the other.
        recent = [ranks for _, ranks in self.samples if ranks][-10:]
        by: dict[str, list[tuple[float, int, int]]] = {pid: [] for r in recent for pid in r}
        for t, ranks in self.samples:
            for pid, (faults, ticks) in ranks.items():
                if pid in by:
                    by[pid].append((t, faults, ticks))
        out = []
        for series in by.values():
            tail = series[-21:]
            if len(tail) < 3:
                continue
            steps = list(zip(tail, tail[1:], strict=False))
            out.append(
                {
                    "faults_per_s": statistics.median(
                        (b[1] - a[1]) / (b[0] - a[0]) for a, b in steps
                    ),
                    "kernel_share": statistics.median(
                        (b[2] - a[2]) / TICKS / (b[0] - a[0]) for a, b in steps
                    ),
                }
            )
        return out


def run_once(args: argparse.Namespace, setting: str, algorithm: str) -> dict[str, Any]:
    """One train.py run of the cell under ``setting``; its cell's numbers and the ranks'."""
    scratch = args.work / "out"
    cell_dir = scratch / "cells" / args.workload / f"{args.network}-2x1"
    for old in cell_dir.glob(f"{algorithm}-s*.json"):
        old.unlink()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train.py"), "--workloads", args.workload]
    cmd += ["--networks", args.network, "--seeds", "0", "--algorithms", algorithm]
    cmd += ["--winner-seeds", "--out", str(scratch), "--work", str(args.work / "runs")]
    env = {**os.environ, "JAXCOMM_HOST_MALLOC": setting}
    train = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, cwd=ROOT)
    sampler = Sampler(train.pid)
    sampler.start()
    code = train.wait()
    sampler.stop.set()
    sampler.join()
    if code != 0:
        raise subprocess.CalledProcessError(code, cmd)
    cell = json.loads((cell_dir / f"{algorithm}-s0.json").read_text())
    return {
        "setting": setting,
        "algorithm": algorithm,
        "step_s": cell["step_s"],
        "time_to_target_s": cell["time_to_target_s"],
        "ranks": sampler.rates(),
    }


def summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (algorithm, setting): runs, runs with a faulting rank, median step and time."""
    rows = []
    for algorithm in dict.fromkeys(r["algorithm"] for r in runs):
        for setting in SETTINGS:
            mine = [r for r in runs if r["algorithm"] == algorithm and r["setting"] == setting]
            if not mine:
                continue
            faulting = [r for r in mine if any(k["faults_per_s"] > FAULTING for k in r["ranks"])]
            done = [r["time_to_target_s"] for r in mine if r["time_to_target_s"] is not None]
            rows.append(
                {
                    "algorithm": algorithm,
                    "setting": setting,
                    "runs": len(mine),
                    "faulting": len(faulting),
                    "median_step_ms": 1000 * statistics.median(r["step_s"] for r in mine),
                    "median_time_to_target_s": statistics.median(done) if done else None,
                }
            )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'algorithm':<16}{'malloc':<8}{'runs':>5}{'faulting':>9}{'ms/step':>9}{'to target':>11}"
    )
    for r in rows:
        t = r["median_time_to_target_s"]
        print(
            f"{r['algorithm']:<16}{r['setting']:<8}{r['runs']:>5}{r['faulting']:>9}"
            f"{r['median_step_ms']:>9.1f}{'-' if t is None else f'{t:.1f} s':>11}"
        )


def draw(runs: list[dict[str, Any]]):
    def plot(ax: Any) -> None:
        for setting, marker in zip(SETTINGS, "ox", strict=True):
            mine = [r for r in runs if r["setting"] == setting]
            xs = [max((k["faults_per_s"] for k in r["ranks"]), default=0) for r in mine]
            ax.scatter(xs, [1000 * r["step_s"] for r in mine], marker=marker, label=setting)

    return plot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="heldout-fivemom")
    parser.add_argument("--network", default="100mbit")
    parser.add_argument("--algorithms", nargs="+", default=["topk_allgather", "auto-bf16"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/host-malloc"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"host-malloc-{args.workload}-{args.network}"
    path = args.out / f"{tag}.json"
    runs = json.loads(path.read_text())["runs"] if path.exists() else []
    for round_ in range(args.rounds):
        for algorithm in args.algorithms:
            for setting in SETTINGS:
                mine = [r for r in runs if (r["algorithm"], r["setting"]) == (algorithm, setting)]
                if len(mine) > round_:
                    continue
                runs.append({**run_once(args, setting, algorithm), "round": round_})
                result = {"workload": args.workload, "network": args.network, "runs": runs}
                result["summary"] = summary(runs)
                write_result_and_plot(
                    args.out,
                    tag,
                    result,
                    draw(runs),
                    figsize=(6, 4),
                    xlabel="page faults a second, the most-faulting rank (median)",
                    ylabel="ms a step",
                    title=f"{args.workload}, {args.network}: glibc malloc",
                )
    print_table(summary(runs))


if __name__ == "__main__":
    main()
