#!/usr/bin/env python3
"""PyTorch's torch.optim.AdamW on the CPU, the reference for headroom's host AdamW
(docs/results/offload.md; headroom's side: build/bin/bench_optimizer_kernels, the same kernel
the host place runs).

    python bench/torch_adamw_rate.py [--reps 5] [--threads 2]

One optimizer step over every parameter tensor of gpt2-124m (the shapes bench/optimizer_kernels.cpp
uses: the embeddings, then per block the LayerNorms, c_attn, attn c_proj, c_fc, mlp c_proj and
their biases, and ln_f), f32 weights, gradients and moments, lr 3e-4, weight decay 0.1, for each
implementation PyTorch has on the CPU: the per-tensor loop (foreach=False), the multi-tensor one
(foreach=True) and the fused kernel (fused=True, where this torch has it). The variants run in
turn, `--reps` rounds (interleaved, so a change of load hits each alike); the table gives each
one's median step time, its rate in parameters per second and GB/s (AdamW reads w, g, m, v and
writes w, m, v: 28 bytes a parameter).
"""
import argparse
import statistics
import time

import torch


def gpt2_124m():
    C, V, T = 768, 50257, 1024
    s = [(V, C), (T, C)]
    for _ in range(12):
        s += [(C,), (C,), (3 * C, C), (3 * C,), (C, C), (C,), (C,), (C,), (4 * C, C), (4 * C,),
              (C, 4 * C), (C,)]
    return s + [(C,), (C,)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    shapes = gpt2_124m()
    n = sum(torch.Size(s).numel() for s in shapes)
    variants = {"foreach=False": dict(foreach=False), "foreach=True": dict(foreach=True)}
    try:
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)], fused=True)
        variants["fused=True"] = dict(fused=True)
    except (RuntimeError, TypeError) as e:
        print(f"fused=True: not available on the CPU here ({e})")
    opts = {}
    for name, kw in variants.items():
        params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                **kw)
        opt.step()  # the first step allocates the moments: left out
        opts[name] = opt
    times = {name: [] for name in opts}
    for _ in range(a.reps):
        for name, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    print(f"torch {torch.__version__}, {a.threads} threads, gpt2-124m: {n} parameters, "
          f"{a.reps} rounds")
    print(f"{'variant':<16}{'median s':>10}{'Mparam/s':>10}{'GB/s':>8}")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:<16}{m:>10.4f}{n / m / 1e6:>10.1f}{28 * n / m / 1e9:>8.2f}")


if __name__ == "__main__":
    main()
