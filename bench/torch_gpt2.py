#!/usr/bin/env python3
"""The GPT-2 that headroom trains, in PyTorch eager: the reference for docs/results/gpu.md.

    python3 bench/torch_gpt2.py --dtype fp32 --attention manual --json FILE

The same model, shapes and step as bench/gpt2-124m-gpu.toml (gpt2-124m, seq_len 1024,
micro_batch 8): token and position embeddings, pre-LayerNorm blocks with causal multi-head
attention and a tanh-GELU MLP, tied LM head without bias, cross-entropy; AdamW (betas 0.9/0.95,
eps 1e-8, weight decay 0.1 on matrices only) with global-norm clipping at 1.0, as headroom's
defaults. No torch.compile, no fused kernels of our own.

--attention manual is the same math as headroom's kernels: scores, causal mask, softmax, the
(B, NH, T, T) probabilities kept for backward, so the memory compares. --attention sdpa uses
F.scaled_dot_product_attention (flash or memory-efficient kernels where they apply): a second row
that says what a fused attention buys, not a like-for-like comparison.

--dtype fp32: fp32 everywhere, TF32 off (headroom's fp32 GEMMs are CUBLAS_COMPUTE_32F).
--dtype bf16-autocast: fp32 weights and optimizer, matmuls in bf16 under torch.autocast; the
  usual PyTorch mixed precision. Not the same as headroom's amp plugin, which stores weights,
  activations and gradients in bf16 (with fp32 master weights): autocast keeps LayerNorm,
  softmax and the loss in fp32 and casts weights on the fly.
--dtype bf16-params: the whole model and AdamW state in bf16, no master weights (less memory than
  either, and a different optimizer numerically).

Reports tokens/s over the steps after --warmup, torch.cuda.max_memory_allocated (the peak of
live tensor bytes, comparable with headroom's tracker peak) and max_memory_reserved (what the
caching allocator took from the driver). --device cpu runs the same code without a GPU (for
checking this script; use --tiny there).
"""

import argparse
import json
import math
import platform
import sys
import time


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["fp32", "bf16-autocast", "bf16-params"], default="fp32")
    p.add_argument("--attention", choices=["manual", "sdpa"], default="manual")
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=15, help="optimizer steps, warmup included")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of tokens/s")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--fused-adamw", action="store_true",
                   help="torch.optim.AdamW(fused=True) instead of the default (foreach)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true",
                   help="a 2-layer, 64-wide model with seq_len 64: for checking the script")
    p.add_argument("--preset", choices=["tiny", "gpt2-124m", "gpt2-350m"],
                   help="headroom's model preset's shape (n_layer, n_head, n_embd, vocab_size); "
                        "--seq-len and --micro-batch stay as given")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (inductor; forward and backward), the optimizer "
                        "step eager")
    p.add_argument("--threads", type=int,
                   help="torch.set_num_threads (CPU): the threads headroom's run is given")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the results to FILE")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.tiny:
        args.n_layer, args.n_head, args.n_embd = 2, 4, 64
        args.vocab_size, args.seq_len, args.micro_batch = 256, 64, 4
    presets = {"tiny": (2, 4, 64, 256), "gpt2-124m": (12, 12, 768, 50257),
               "gpt2-350m": (24, 16, 1024, 50257)}
    if args.preset:
        args.n_layer, args.n_head, args.n_embd, args.vocab_size = presets[args.preset]
    if args.warmup >= args.steps:
        sys.exit("torch_gpt2: --warmup must be less than --steps")
    if args.n_embd % args.n_head:
        sys.exit("torch_gpt2: n_embd must be divisible by n_head")

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("torch_gpt2: no CUDA device (use --device cpu to check the script)")
    # fp32 means fp32: headroom's fp32 matmuls use no TF32.
    try:
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    except (AttributeError, RuntimeError):  # before torch 2.9
        torch.backends.cuda.matmul.allow_tf32 = False
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    L, NH, C, V, T, B = (args.n_layer, args.n_head, args.n_embd, args.vocab_size, args.seq_len,
                         args.micro_batch)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(C)
            self.c_attn = nn.Linear(C, 3 * C)
            self.c_proj = nn.Linear(C, C)
            self.ln_2 = nn.LayerNorm(C)
            self.c_fc = nn.Linear(C, 4 * C)
            self.c_proj_mlp = nn.Linear(4 * C, C)
            self.register_buffer("mask", torch.tril(torch.ones(T, T, dtype=torch.bool)),
                                 persistent=False)

        def attention(self, x):
            b, t, _ = x.shape
            q, k, v = self.c_attn(x).split(C, dim=2)
            q = q.view(b, t, NH, C // NH).transpose(1, 2)
            k = k.view(b, t, NH, C // NH).transpose(1, 2)
            v = v.view(b, t, NH, C // NH).transpose(1, 2)
            if args.attention == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // NH))
                att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
                att = F.softmax(att, dim=-1)
                y = att @ v
            return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, C))

        def forward(self, x):
            x = x + self.attention(self.ln_1(x))
            return x + self.c_proj_mlp(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, C)
            self.wpe = nn.Embedding(T, C)
            self.h = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(C)
            for name, prm in self.named_parameters():
                if prm.dim() == 2:
                    std = 0.02 / math.sqrt(2 * L) if name.endswith("c_proj.weight") or \
                        name.endswith("c_proj_mlp.weight") else 0.02
                    nn.init.normal_(prm, 0.0, std)
                elif name.endswith("bias"):
                    nn.init.zeros_(prm)

        def forward(self, idx, targets):
            t = idx.shape[1]
            x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
            for block in self.h:
                x = block(x)
            logits = F.linear(self.ln_f(x), self.wte.weight)  # tied LM head
            return F.cross_entropy(logits.float().view(-1, V), targets.view(-1))

    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    model = GPT().to(dev)
    if args.dtype == "bf16-params":
        model = model.to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    # The optimizer holds the parameters of `model`; the compiled module shares them.
    step_model = torch.compile(model) if args.compile else model
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt_kwargs = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    if args.fused_adamw:
        opt_kwargs["fused"] = True
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], **opt_kwargs)

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)
    step_s, losses = [], []
    for step in range(args.steps):
        # Random tokens made on the device: the data costs nothing here; headroom's synthetic
        # source is made on the host by a prefetching thread, off the step's critical path.
        data = torch.randint(0, V, (B, T + 1), device=dev, generator=gen)
        idx, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        sync()
        t0 = time.perf_counter()
        if args.dtype == "bf16-autocast":
            with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
                loss = step_model(idx, targets)
        else:
            loss = step_model(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # waits for the step, as headroom reads its loss each step
        sync()
        step_s.append(time.perf_counter() - t0)
        if not math.isfinite(losses[-1]):
            sys.exit(f"torch_gpt2: loss is {losses[-1]} at step {step + 1}")

    timed = step_s[args.warmup:]
    tokens_per_s = B * T * len(timed) / sum(timed)
    res = {
        "framework": "pytorch",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu",
        "dtype": args.dtype,
        "attention": args.attention,
        "adamw": "fused" if args.fused_adamw else "default (foreach)",
        "compile": bool(args.compile),
        "threads": torch.get_num_threads(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "n_layer": L, "n_head": NH, "n_embd": C, "vocab_size": V, "seq_len": T,
        "micro_batch": B, "grad_accum": 1, "steps": args.steps, "warmup": args.warmup,
        "params": n_params,
        "tokens_per_s": tokens_per_s,
        "step_ms": [1e3 * s for s in step_s],
        "step_ms_median": 1e3 * sorted(timed)[len(timed) // 2],
        "loss_first": losses[0], "loss_last": losses[-1],
        "mem_peak_allocated_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None,
        "mem_peak_reserved_bytes": torch.cuda.max_memory_reserved(dev) if cuda else None,
    }
    gib = 1 << 30
    mem = (f"peak allocated {res['mem_peak_allocated_bytes'] / gib:.2f} GiB, reserved "
           f"{res['mem_peak_reserved_bytes'] / gib:.2f} GiB" if cuda else "no memory figures on cpu")
    print(f"torch {torch.__version__} on {res['device']}: gpt2 L{L} C{C} T{T} B{B}, {args.dtype}, "
          f"{args.attention} attention, {'compiled' if args.compile else 'eager'}, "
          f"{torch.get_num_threads()} threads, {n_params / 1e6:.1f} M params")
    print(f"  {tokens_per_s:,.0f} tokens/s (median step {res['step_ms_median']:.1f} ms, "
          f"{len(timed)} steps after {args.warmup} warmup), {mem}, "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
