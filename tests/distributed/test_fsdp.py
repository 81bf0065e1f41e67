"""StableFSDPStrategy in real multi-process runs (torchrun, gloo on CPU) against one-process references.

Every comparison is with a plain single-device Lightning run of the same model on the same global
batch of 8 sequences (per-rank batch ``8 / world_size``), computed in this process.

Tolerance: fp32 weights after 20 AdamW steps agree within ``WEIGHT_ATOL = 2e-6`` absolute (largest
weight ~4; measured: 1.2e-7 for 2 processes, 2.4e-7 for 2 nodes x 2; the only difference is the
summation order of the gradient reduction); logged norms and losses agree within a relative ``1e-6``
(measured: 1.8e-7). Reloaded weights must be bitwise equal to the saved ones.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_stability.grad_norm import GradientNormMonitor
from lightning_stability.ledger.step_ledger import Outcome
from lightning_stability.strategies.fsdp_checkpoint import META_FILE, consolidate_checkpoint
from tests.distributed.fsdp_common import ListLogger, TinyLM
from tests.helpers import REPO, quiet_trainer, torchrun

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("fsdp_run.py")
WEIGHT_ATOL = 2e-6
NORM_RTOL = 1e-6
MONITOR = {"max_norm": 0.5}
STEPS = 20  # two epochs of ten global batches


# ---------------------------------------------------------------------- launching
def _write_specs(out: Path, specs: list[dict[str, Any]]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "specs.json"
    path.write_text(json.dumps(specs))
    return path


def launch(out: Path, nproc: int, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return torchrun(SCRIPT, nproc, out, str(_write_specs(out, specs)), timeout=240)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_two_nodes(out: Path, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Two ``torchrun --nnodes 2 --node_rank {0,1} --nproc_per_node 2`` launched at once on localhost."""
    spec_file = _write_specs(out, specs)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    port = _free_port()
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node_rank={rank}",
                "--nproc_per_node=2",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                str(SCRIPT),
                str(out),
                str(spec_file),
            ],
            env=env,
            cwd=out,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # so a hang can be ended with the workers, by process group
        )
        for rank in (0, 1)
    ]
    logs = []
    for node in nodes:
        try:
            logs.append(node.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for other in nodes:
                os.killpg(other.pid, signal.SIGKILL)
            raise
    if any(node.returncode for node in nodes):
        raise AssertionError("two-node torchrun failed:\n" + "\n----\n".join(log[-6000:] for log in logs))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def weights(out: Path, name: str, which: str = "final") -> dict[str, torch.Tensor]:
    return torch.load(out / f"{name}.weights.pt")[which]  # type: ignore[no-any-return]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ---------------------------------------------------------------------- one-process references
def reference(max_steps: int = STEPS, monitor: dict[str, Any] | None = None, **trainer_kwargs: Any) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = TinyLM(batch_size=8)
    logger = ListLogger()
    callbacks = [GradientNormMonitor(log_every_n_steps=1, **monitor)] if monitor is not None else []
    trainer = quiet_trainer(
        max_steps=max_steps, max_epochs=100, logger=logger, callbacks=callbacks, log_every_n_steps=1, **trainer_kwargs
    )
    trainer.fit(module)
    return {
        "weights": {n: p.detach().clone() for n, p in module.named_parameters()},
        "losses": [float(v) for v in module.losses],
        "metrics": logger.history,
    }


@pytest.fixture(scope="module")
def ref_monitor() -> dict[str, Any]:
    return reference(monitor=MONITOR)


# ---------------------------------------------------------------------- two processes
TWO_PROC_RUNS: list[dict[str, Any]] = [
    {"name": "monitor", "monitor": MONITOR, "trainer": {"max_steps": STEPS, "max_epochs": 2}},
    {"name": "trainer_clip", "trainer": {"max_steps": STEPS, "max_epochs": 2, "gradient_clip_val": 0.5}},
    {"name": "accumulate", "trainer": {"max_steps": 4, "accumulate_grad_batches": 2}},
    {"name": "no_accumulate", "trainer": {"max_steps": 8}},
    {
        "name": "fp16_inf",
        "monitor": {},
        "strategy": {"mixed_precision": True},
        "inject_inf_at": [3, 1],
        "trainer": {"max_steps": 6},
    },
    {"name": "bf16", "strategy": {"mixed_precision": "bf16-mixed"}, "trainer": {"max_steps": 10}},
    {"name": "ac", "strategy": {"activation_checkpointing": True}, "trainer": {"max_steps": 3}},
    {"name": "no_ac", "trainer": {"max_steps": 3}},
    {"name": "keep_gathered", "strategy": {"reshard_after_forward": False}, "trainer": {"max_steps": 3}},
    {"name": "self_sharding", "model_class": "SelfShardingLM", "trainer": {"max_steps": 4}},
    {"name": "syncs_clip", "count_syncs": True, "trainer": {"max_steps": 4, "gradient_clip_val": 0.5}},
    {"name": "syncs_bare", "count_syncs": True, "trainer": {"max_steps": 4}},
]


@pytest.fixture(scope="module")
def two_proc(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("fsdp2")
    runs = [
        *TWO_PROC_RUNS,
        # ten steps with the monitor's config, saved both ways: resumed below at other world sizes
        {"name": "save_sharded", "monitor": MONITOR, "trainer": {"max_epochs": 1}, "save": str(out / "sharded.ckpt")},
        {
            "name": "save_full",
            "monitor": MONITOR,
            "trainer": {"max_epochs": 1},
            "strategy": {"state_dict_type": "full"},
            "save": str(out / "full.ckpt"),
        },
    ]
    return out, launch(out, 2, runs)


def test_two_processes_end_with_the_weights_of_one_process_with_clipping_active(two_proc, ref_monitor) -> None:
    out, results = two_proc
    assert max_diff(weights(out, "monitor"), ref_monitor["weights"]) < WEIGHT_ATOL
    coefs = [v for _, v in results[0]["monitor"]["metrics"]["stability/clip_coef"]]
    assert len(coefs) == STEPS and sum(c < 0.999 for c in coefs) >= STEPS // 2  # clipping was active
    assert results[0]["monitor"]["losses"] == pytest.approx(ref_monitor["losses"], rel=NORM_RTOL)


def test_logged_global_norm_equals_the_single_process_norm(two_proc, ref_monitor) -> None:
    _, results = two_proc
    ref = [v for _, v in ref_monitor["metrics"]["stability/grad_norm"]]
    for rank in (0, 1):
        logged = [v for _, v in results[rank]["monitor"]["metrics"].get("stability/grad_norm", [])]
        if rank == 0:
            assert logged == pytest.approx(ref, rel=NORM_RTOL)
        local = results[rank]["monitor"]["local_norms"]
        # what a shard-local norm would have given: far off (this is what the test would catch)
        assert all(abs(loc / r - 1) > 0.05 for loc, r in zip(local, ref, strict=True))


def test_trainer_gradient_clip_val_clips_by_the_global_norm(two_proc) -> None:
    out, _ = two_proc
    ref = reference(gradient_clip_val=0.5, gradient_clip_algorithm="norm")
    unclipped = reference()
    assert max_diff(weights(out, "trainer_clip"), ref["weights"]) < WEIGHT_ATOL
    assert max_diff(ref["weights"], unclipped["weights"]) > 100 * WEIGHT_ATOL  # clipping changed the result


def test_gradient_accumulation_reduce_scatters_only_on_the_last_micro_batch(two_proc) -> None:
    out, results = two_proc
    units_with_params = 3  # two blocks + the top-level TinyGPT unit (the root holds no parameters)
    for rank in (0, 1):
        assert results[rank]["no_accumulate"]["reduce_scatters"] == 8 * units_with_params
        assert results[rank]["accumulate"]["reduce_scatters"] == 4 * units_with_params
    ref = reference(max_steps=4, accumulate_grad_batches=2)
    assert max_diff(weights(out, "accumulate"), ref["weights"]) < WEIGHT_ATOL


def test_fp16_inf_in_one_ranks_shard_skips_the_step_on_every_rank(two_proc) -> None:
    out, results = two_proc
    r0, r1 = results[0]["fp16_inf"], results[1]["fp16_inf"]
    assert r0["scaler"] == r1["scaler"] == "ShardedGradScaler"
    assert r0["precision"] == "16-mixed"
    # mixed_precision=True: fp16 compute, fp32 gradient reduction and master weights
    assert r0["compute_dtypes"] == ["torch.float16"] and r0["reduce_dtypes"] == ["torch.float32"]
    assert r0["param_dtypes"] == ["torch.float32"]
    # only rank 1 wrote an inf (step index 3); both ranks backed off the scale and skipped
    assert r0["scales"] == r1["scales"]
    assert r0["scales"][3] == r0["scales"][2] / 2
    for r in (r0, r1):
        assert r["ledger_counts"][Outcome.SKIPPED_SCALER] == 1
        assert r["ledger_counts"][Outcome.APPLIED] == 5
    assert all(torch.isfinite(w).all() for w in weights(out, "fp16_inf").values())


def test_bf16_computes_in_bf16_but_keeps_fp32_master_weights_and_gradients(two_proc) -> None:
    _, results = two_proc
    run = results[0]["bf16"]
    assert run["precision"] == "bf16-mixed"
    assert run["compute_dtypes"] == ["torch.bfloat16"]
    assert run["reduce_dtypes"] == ["torch.float32"]  # the reduce-scatter inputs: fp32 by default
    assert run["param_dtypes"] == ["torch.float32"] and run["grad_dtypes"] == ["torch.float32"]
    assert run["losses"][-1] < run["losses"][0]


def test_activation_checkpointing_recomputes_blocks_and_changes_nothing(two_proc) -> None:
    out, results = two_proc
    assert results[0]["no_ac"]["block_calls"] == 3
    assert results[0]["ac"]["block_calls"] == 6  # forward + recomputation in backward
    assert results[0]["ac"]["losses"] == results[0]["no_ac"]["losses"]
    assert max_diff(weights(out, "ac"), weights(out, "no_ac")) == 0.0


def test_reshard_after_forward_false_changes_memory_not_results(two_proc) -> None:
    out, results = two_proc
    assert results[0]["keep_gathered"]["losses"] == results[0]["no_ac"]["losses"]
    assert max_diff(weights(out, "keep_gathered"), weights(out, "no_ac")) == 0.0


def test_a_module_that_shards_itself_in_configure_model_is_respected(two_proc) -> None:
    out, results = two_proc
    # one unit (its TinyGPT), not the strategy's three: one reduce-scatter per step
    assert results[0]["self_sharding"]["reduce_scatters"] == 4
    ref = reference(max_steps=4)
    assert max_diff(weights(out, "self_sharding"), ref["weights"]) < WEIGHT_ATOL


def test_global_norm_clipping_adds_no_host_sync(two_proc) -> None:
    _, results = two_proc
    for rank in (0, 1):
        assert results[rank]["syncs_clip"]["syncs_per_step"] == results[rank]["syncs_bare"]["syncs_per_step"]


# ---------------------------------------------------------------------- resharding checkpoints
def _resume(name: str, path: Path) -> dict[str, Any]:
    return {"name": name, "monitor": MONITOR, "trainer": {"max_epochs": 2}, "resume": str(path)}


def _check_resumed(
    out_resume: Path,
    result: dict[str, Any],
    name: str,
    out_save: Path,
    saved: str,
    two_proc_results: list[dict[str, Any]],
) -> None:
    # the weights right after loading are the saved ones, exactly
    assert max_diff(weights(out_resume, name, "start"), weights(out_save, saved)) == 0.0
    # training goes on: the next loss, and every loss after it, is the uninterrupted two-process run's
    uninterrupted = two_proc_results[0]["monitor"]
    assert result["losses"] == pytest.approx(uninterrupted["losses"][10:], rel=NORM_RTOL)
    assert max_diff(weights(out_resume, name), weights(out_save, "monitor")) < WEIGHT_ATOL
    # the ledger (checkpoint["lightning_stability"]) survived: 10 restored steps + 10 new ones
    assert result["ledger_steps"] == STEPS and result["global_step"] == STEPS


@pytest.fixture(scope="module")
def one_proc(two_proc, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    saved, _ = two_proc
    out = tmp_path_factory.mktemp("fsdp1")
    runs = [
        _resume("from_sharded", saved / "sharded.ckpt"),
        _resume("from_full", saved / "full.ckpt"),
        # setup-time errors need a process group, so they run here too
        {"name": "wraps_nothing", "expect_error": True, "strategy": {"wrap_classes": ["Conv2d"]}},
        {"name": "bad_mesh", "expect_error": True, "strategy": {"sharding": "hybrid", "device_mesh": [2, 2]}},
    ]
    return out, launch(out, 1, runs)


def test_sharded_checkpoint_from_two_processes_resumes_with_one(two_proc, one_proc) -> None:
    saved, results = two_proc
    out, one = one_proc
    # each rank wrote its own shard file (torch.distributed.checkpoint names them __{rank}_{i}.distcp)
    assert sorted(p.name.split("_")[2] for p in (saved / "sharded.ckpt").glob("*.distcp")) == ["0", "1"]
    meta = torch.load(saved / "sharded.ckpt" / META_FILE, weights_only=False)
    assert "ledger" in meta["lightning_stability"] and "state_dict" not in meta
    assert any("GradientNormMonitor" in key for key in meta["callbacks"])
    _check_resumed(out, one[0]["from_sharded"], "from_sharded", saved, "save_sharded", results)


def test_full_checkpoint_from_two_processes_resumes_with_one(two_proc, one_proc) -> None:
    saved, results = two_proc
    out, one = one_proc
    _check_resumed(out, one[0]["from_full"], "from_full", saved, "save_full", results)


def test_policy_that_wraps_nothing_and_mesh_of_wrong_size_fail_at_setup(one_proc) -> None:
    _, one = one_proc
    assert one[0]["wraps_nothing"]["error"] is not None
    assert "wraps no module of TinyLM" in one[0]["wraps_nothing"]["error"]
    assert "Block x2" in one[0]["wraps_nothing"]["error"]  # names what could be wrapped
    assert "does not cover the world size 1" in one[0]["bad_mesh"]["error"]


def test_consolidate_checkpoint_makes_one_file_a_plain_module_loads(two_proc, tmp_path) -> None:
    out, _ = two_proc
    saved = weights(out, "save_sharded")
    merged = consolidate_checkpoint(out / "sharded.ckpt", tmp_path / "merged.ckpt")
    checkpoint = torch.load(merged, weights_only=False)
    full = torch.load(out / "full.ckpt", weights_only=False)
    assert checkpoint["state_dict"].keys() == full["state_dict"].keys()
    assert all(torch.equal(checkpoint["state_dict"][k], full["state_dict"][k]) for k in full["state_dict"])
    # optimizer states by index, as Optimizer.state_dict() has them: a plain optimizer takes them
    plain = TinyLM()
    plain.load_state_dict(checkpoint["state_dict"])
    assert max_diff({n: p.detach() for n, p in plain.named_parameters()}, saved) == 0.0
    optimizer = plain.configure_optimizers()
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    assert len(optimizer.state) == len(saved)
    assert checkpoint["lightning_stability"]["ledger"]["tracks"]["0"]["steps"] == 10
    exported = consolidate_checkpoint(out / "sharded.ckpt", tmp_path / "model.pt", weights_only=True)
    assert set(torch.load(exported).keys()) == set(full["state_dict"].keys())


# ---------------------------------------------------------------------- two nodes
@pytest.fixture(scope="module")
def four_proc(two_proc, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Two emulated nodes of two processes: hybrid and full sharding, and the 2 -> 4 resume."""
    saved, _ = two_proc
    out = tmp_path_factory.mktemp("fsdp4")
    runs = [
        {
            "name": "hybrid",
            "monitor": MONITOR,
            "strategy": {"sharding": "hybrid"},
            "trainer": {"max_steps": STEPS, "max_epochs": 2},
        },
        {"name": "full", "monitor": MONITOR, "trainer": {"max_steps": STEPS, "max_epochs": 2}},
        _resume("from_sharded", saved / "sharded.ckpt"),
    ]
    return out, launch_two_nodes(out, runs)


def test_two_nodes_hybrid_and_full_sharding_match_one_process(four_proc, ref_monitor) -> None:
    out, results = four_proc
    hybrid, full = results[0]["hybrid"], results[0]["full"]
    assert hybrid["mesh_shape"] == [2, 2] and hybrid["mesh_dims"] == ["replicate", "shard"]
    assert hybrid["placements"] == "(Replicate(), Shard(dim=0))"
    assert full["mesh_shape"] == [4] and full["placements"] == "(Shard(dim=0),)"
    ref_norms = [v for _, v in ref_monitor["metrics"]["stability/grad_norm"]]
    for name in ("hybrid", "full"):
        assert max_diff(weights(out, name), ref_monitor["weights"]) < WEIGHT_ATOL
        logged = [v for _, v in results[0][name]["metrics"]["stability/grad_norm"]]
        assert logged == pytest.approx(ref_norms, rel=NORM_RTOL)


def test_sharded_checkpoint_from_two_processes_resumes_with_four(two_proc, four_proc) -> None:
    saved, results = two_proc
    out, four = four_proc
    for rank in range(4):
        assert four[rank]["from_sharded"]["ledger_steps"] == STEPS
    _check_resumed(out, four[0]["from_sharded"], "from_sharded", saved, "save_sharded", results)
