"""Tensor parallelism on 4 CPU processes against one process, on the same global batches, in one run.

The model and its plan are ``tests/distributed/tensor_parallel_script.py``'s (a tied embedding / LM head, a
replicated LayerNorm, a column/row-parallel MLP, a ``SequenceParallel`` final norm, a plain gate), trained
``--steps`` AdamW steps, clipped at 0.5 (every step clips). Runs, each a ``torchrun`` launch (gloo):

* ``reference``: one process, no parallelism;
* per mesh (data parallel x tensor parallel: 2 x 2, 1 x 4):
  ``ours``: Lightning's ``ModelParallelStrategy`` + ``GradientNormMonitor(max_norm=0.5)`` and
  ``TrainingHealthMonitor``; ``bare``: the same strategy without any callback and without clipping (the
  step-time baseline); ``lightning clip``: the same strategy with Lightning's own ``gradient_clip_val=0.5``;
* ``StableFSDPStrategy(tensor_parallel=2)`` on 2 x 2 with our callbacks.

Printed per run: the largest relative difference of the logged gradient norm from the reference over all
steps, the largest absolute difference of the final weights, the bytes of parameters on the largest rank
against the reference's / (DP x TP), and the median step time (first 2 steps dropped) against ``bare`` on the
same mesh, measured in the same run, from a second launch with the callbacks as a user attaches them
(``GradientNormMonitor(max_norm=0.5)``, ``TrainingHealthMonitor("warn")``, the Trainer's logging cadence) and
none of the accuracy run's per-step probes. On a 2-core machine 4 processes share 2 cores, so the times say what the
callbacks add, not how fast tensor parallelism is.

Usage (from the repository root)::

    python -m benchmarks.tensor_parallel            # --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "distributed" / "tensor_parallel_script.py"


def launch(out: Path, dp: int, tp: int, mode: str, steps: int, timing: bool = False) -> list[dict[str, Any]]:
    out.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TP_STEPS=str(steps))
    if timing:
        env["TP_TIMING"] = "1"
    world = dp * tp
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    subprocess.run([*cmd, str(SCRIPT), str(out), str(dp), str(tp), mode], env=env, check=True, capture_output=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def median_step(result: dict[str, Any]) -> float:
    return statistics.median(result["step_times"][2:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ref = launch(root / "reference", 1, 1, "lightning", args.steps)[0]
        ref_final = torch.load(root / "reference" / "final.pt")
        rows = []
        for dp, tp in ((2, 2), (1, 4)):
            mesh = f"{dp} x {tp}"
            bare = launch(root / f"bare{dp}{tp}", dp, tp, "bare", args.steps)
            bare_time = max(median_step(r) for r in bare)
            runs = [("ModelParallelStrategy + ours", "lightning"), ("ModelParallelStrategy, lightning clip", "clip")]
            if dp > 1:
                runs.append(("StableFSDPStrategy(tensor_parallel=2) + ours", "stable"))
            for name, mode in runs:
                results = launch(root / f"{mode}{dp}{tp}", dp, tp, mode, args.steps)
                if "error" in results[0]:
                    rows.append((mesh, name, f"fails: {results[0]['error'][:90]}"))
                    continue
                norm_err = max(
                    abs(r["metrics"][i]["stability/grad_norm"] - ref["metrics"][i]["stability/grad_norm"])
                    / ref["metrics"][i]["stability/grad_norm"]
                    for r in results
                    for i in range(args.steps)
                )
                final = torch.load(root / f"{mode}{dp}{tp}" / "final.pt")
                weight_err = max(float((final[k] - ref_final[k]).abs().max()) for k in ref_final)
                bytes_ratio = max(r["param_bytes"] for r in results) / (ref["param_bytes"] / (dp * tp))
                timed = launch(root / f"{mode}{dp}{tp}t", dp, tp, mode, args.steps, timing=True)
                time_ratio = max(median_step(r) for r in timed) / bare_time
                rows.append(
                    (
                        mesh,
                        name,
                        f"norm rel err {norm_err:.1e}, weights abs err {weight_err:.1e}, "
                        f"param bytes (largest rank) x{bytes_ratio:.2f} of 1/(DPxTP), "
                        f"step time x{time_ratio:.2f} of bare ({1e3 * bare_time:.1f} ms)",
                    )
                )
    print(
        f"{args.steps} steps; reference: 1 process, {ref['param_bytes']} parameter bytes; torch {torch.__version__}; "
        f"{os.cpu_count()} CPUs; {time.perf_counter() - start:.0f} s"
    )
    for mesh, name, text in rows:
        print(f"{mesh}  {name:<46} {text}")


if __name__ == "__main__":
    main()
