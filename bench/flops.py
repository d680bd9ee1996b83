"""Model FLOPs for the benchmarks, and the FLOP/s this machine's matmul reaches in the same dtype.

    forward  ~ 2 x (body parameters x tokens + d x head columns x head rows)
    training ~ 6 x (the same)                        (forward + backward: ~2x the forward again)
body = the transformer without its embedding table (a lookup, not a matmul); the head is counted as
it runs: only on the rows it scores, over the columns it scores (the vocabulary, or the SID tokens).
Attention's score matmuls (~ tokens x context x d) are left out: at prompts of ~100 tokens they are
a few percent of the total.
"""
import time

import torch


def body_params(model) -> int:
    """Parameters of the transformer body: every parameter of the base model except the embedding."""
    return sum(p.numel() for p in model.base_model.parameters()) - model.get_input_embeddings().weight.numel()


def matmul_flops(device, ctx, n: int = 2048, reps: int = 10, rounds: int = 5) -> float:
    """FLOP/s of an (n x n) @ (n x n) fp32 matmul under the run's autocast context (bf16 or not):
    the fastest of `rounds` timings of `reps` products, after a warm-up round. One warm-up product is
    not enough on CPU: the first rounds ran at half the later rate (bf16 670 vs 1,400 GFLOP/s here)."""
    a, b = (torch.randn(n, n, device=device) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = 0.0
    with ctx:
        for r in range(rounds + 1):                                      # round 0 warms up
            sync()
            t = time.perf_counter()
            for _ in range(reps):
                a @ b
            sync()
            best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - t)) if r else 0.0
    return best


def gflops(x: float) -> str:
    return f"{x / 1e9:.1f} GFLOP/s"
