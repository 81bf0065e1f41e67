"""How fast is GradientNormMonitor's norm? Ratios against baselines measured in the same run.

On the gradients of a 12-layer transformer, times:

* ``ours``      -- ``lightning_stability.norms.total_norm`` (fused per-tensor norms, one reduction);
* ``item-loop`` -- a common hand-written loop: ``p.grad.norm(2).item() ** 2`` per parameter (one host sync each);
* ``lightning`` -- Lightning's ``lightning.pytorch.utilities.grad_norm`` utility;
* ``floor``     -- one copy of every gradient byte: the memory-bandwidth floor, taken as the faster of
  ``torch._foreach_copy_`` and a per-tensor ``copy_`` loop (on some CPUs the loop is faster).

Every method ends with one ``.item()`` on its result, so each is timed to a finished, host-visible value.
Prints the median time of each as a ratio to the floor and to ours. Usage::

    python -m benchmarks.grad_norm            # CPU
    python -m benchmarks.grad_norm --device cuda --d-model 1024
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import nn

from lightning_stability.norms import total_norm


def build_gradients(d_model: int, layers: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model, nhead=8, dim_feedforward=4 * d_model, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False).to(device)
    x = torch.randn(4, 64, d_model, device=device)
    model(x).square().mean().backward()
    return model


def item_loop(model: nn.Module) -> float:
    total = 0.0
    for p in model.parameters():
        if p.grad is not None:
            total += p.grad.detach().norm(2).item() ** 2  # one host sync per parameter tensor
    return total**0.5


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)

    model = build_gradients(args.d_model, args.layers, args.device)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    buffers = [torch.empty_like(g) for g in grads]
    nbytes = sum(g.numel() * g.element_size() for g in grads)

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    methods: dict[str, Callable[[], float]] = {
        "ours": lambda: total_norm(grads).item(),
        "item-loop": lambda: item_loop(model),
        "lightning": lambda: lightning_grad_norm(model, norm_type=2)["grad_2.0_norm_total"].item(),
        "copy_foreach": lambda: (torch._foreach_copy_(buffers, grads), buffers[-1].reshape(-1)[0].item())[1],
        "copy_loop": lambda: (
            [b.copy_(g) for b, g in zip(buffers, grads, strict=True)],
            buffers[-1][0].item(),
        )[1],
    }
    reference = torch.nn.utils.get_total_norm(grads).item()
    for name in ("ours", "item-loop", "lightning"):
        value = methods[name]()
        # Lightning's utility rounds through float32 the same way; all must agree to fp32 precision
        assert abs(value - reference) <= 1e-4 * reference, (name, value, reference)

    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(3):  # warm-up
        for fn in methods.values():
            fn()
    # Rounds of short blocks: each method runs `block` times in a row (its steady state), and the
    # rounds alternate the methods so that drift on a shared machine hits every method alike.
    block = 5
    for _ in range(max(1, args.repeats // block)):
        for name, fn in methods.items():
            for _ in range(block):
                sync()
                start = time.perf_counter()
                fn()
                sync()
                times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    median["floor"] = min(median.pop("copy_foreach"), median.pop("copy_loop"))

    params = sum(g.numel() for g in grads)
    print(f"gradients: {len(grads)} tensors, {params / 1e6:.1f}M values, {nbytes / 2**20:.0f} MiB on {args.device}")
    print(f"{'method':<10} {'x floor':>8} {'x ours':>8}")
    for name in median:
        print(f"{name:<10} {median[name] / median['floor']:>8.2f} {median[name] / median['ours']:>8.2f}")
    ratios = {
        "ours_vs_floor": median["ours"] / median["floor"],
        "item_loop_vs_ours": median["item-loop"] / median["ours"],
        "lightning_vs_ours": median["lightning"] / median["ours"],
    }
    verdict = (
        ratios["ours_vs_floor"] <= 1.5 and ratios["item_loop_vs_ours"] >= 1.0 and ratios["lightning_vs_ours"] >= 1.0
    )
    print(f"target (ours <= 1.5x floor, no slower than the item loop or lightning): {'met' if verdict else 'NOT met'}")
    return ratios


if __name__ == "__main__":
    main()
