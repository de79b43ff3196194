#!/usr/bin/env python3
"""Activations at the physical limit (docs/results/activations.md): the naive attention and full
logits against the tiled attention and chunked loss, on gpt2-124m, alone and with checkpoint every.

    bench/activations.py [--headroom build/bin/headroom] [--today OLD/bin/headroom]
                         [--seq 512 1024] [--micro-batch 4] [--steps 3] [--rounds 1]

--today names a headroom built from a commit before this work (b38631a: the naive attention and
full logits with blocks that keep their LayerNorm and GELU outputs, 16·N·C): its "naive + full"
runs as the first variant, "today", and the ratios are against it.

For each seq_len and variant it runs `headroom train` (CPU backend, AdamW) and reads the metrics:
the peak total and the bytes by category at that peak (the tracker's, exact), and the step time
(median of the steps from step 2 on; step 1 allocates the optimizer state). Within a round every
variant of a seq_len runs once, one after the other, so what else the machine does weighs on each
alike; ratios are against the naive variant of the same seq_len and checkpoint setting. It also
prints `headroom plan`'s estimate of the activations at the peak, and the per-block closed forms
next to Korthikanti et al.'s 34·s·b·h + 5·a·s²·b (bytes, 16-bit activations).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile

MIB = 1024.0 * 1024.0
NAIVE = 'attention = "naive"\nloss = "full"\n'
VARIANTS = [  # name, [model] keys, binary ("today": --today's)
    ("naive + full", NAIVE, "new"),
    ("tiled + chunked", 'attention = "tiled"\nloss = "chunked"\n', "new"),
]
CHECKPOINT = '\n[[plugins]]\nname = "checkpoint"\npolicy = "every"\n'


def config_text(seq, micro_batch, keys, checkpoint):
    text = (f'[model]\npreset = "gpt2-124m"\nseq_len = {seq}\n{keys}'
            f'[train]\nmicro_batch = {micro_batch}\n')
    return text + (CHECKPOINT if checkpoint else "")


def train(headroom, path, steps, metrics):
    if os.path.exists(metrics):
        os.remove(metrics)
    out = subprocess.run([headroom, "train", path, "--metrics", metrics, "--set",
                          f"train.steps={steps}"], check=True, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True).stdout
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    # The end-of-run memory report: each category at the total peak and its own peak.
    report = out[out.rfind("memory report"):]

    def row(category):
        m = re.search(category + r"\s+([\d.]+) (B|KiB|MiB|GiB)\s+([\d.]+) (B|KiB|MiB|GiB)", report)
        return to_bytes(m.group(1), m.group(2)), to_bytes(m.group(3), m.group(4))

    act_at, act_own = row("activations")
    ws_at, _ = row("workspace")
    return {
        "step_s": statistics.median(r["step_ms"] for r in rows if r["step"] >= 2) / 1000.0,
        "peak": rows[-1]["mem_peak_bytes"],
        "act": act_at,
        "act_own": act_own,
        "ws": ws_at,
        "loss": [r["loss"] for r in rows],
    }


def to_bytes(value, unit):
    return float(value) * {"B": 1, "KiB": 1024.0, "MiB": MIB, "GiB": 1024.0 * MIB}[unit]


def plan_activations(headroom, path):
    out = subprocess.run([headroom, "plan", path], capture_output=True, text=True).stdout
    # the last "estimated peak" block: the config as written, its plugins included
    block = out[out.rfind("estimated peak"):]
    m = re.search(r"activations\s+([\d.]+) (KiB|MiB|GiB)", block)
    scale = {"KiB": 1 / 1024.0, "MiB": 1.0, "GiB": 1024.0}[m.group(2)]
    return float(m.group(1)) * scale


def block_bytes(s, b, h, a, tiled, es=4, ss=4, kept=10):
    """model.cpp's gpt_block_activation_bytes for an unpruned GPT-2 block (kept = 16: before the
    LayerNorm and GELU outputs were computed again in backward)."""
    n = s * b
    return es * kept * n * h + ss * 4 * n + (ss * n * a if tiled else es * n * a * s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--headroom", default="build/bin/headroom")
    ap.add_argument("--seq", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-checkpoint", action="store_true", help="skip the checkpoint rows")
    ap.add_argument("--today", help="a headroom built before this work: today's naive + full")
    a = ap.parse_args()
    variants = ([("today: naive + full", NAIVE, "today")] if a.today else []) + VARIANTS
    binary = {"new": a.headroom, "today": a.today}
    ckpts = [False] if a.no_checkpoint else [False, True]
    results = {}
    with tempfile.TemporaryDirectory() as d:
        metrics = os.path.join(d, "m.jsonl")
        for r in range(a.rounds):
            for seq in a.seq:
                for ck in ckpts:
                    for name, keys, which in variants:
                        path = os.path.join(d, "c.toml")
                        with open(path, "w") as f:
                            f.write(config_text(seq, a.micro_batch, keys, ck))
                        res = train(binary[which], path, a.steps, metrics)
                        res["plan_act_mib"] = plan_activations(binary[which], path)
                        results.setdefault((seq, ck, name), []).append(res)
                        print(f"round {r + 1} seq {seq} checkpoint {ck} {name}: "
                              f"{res['step_s']:.2f} s/step, peak {res['peak'] / MIB:.1f} MiB, "
                              f"activations {res['act'] / MIB:.1f} MiB", flush=True)
    print()
    print("| seq_len | checkpoint | variant | activations at peak (MiB) | plan's estimate (MiB) "
          "| activations' own peak (MiB) | workspace at peak (MiB) | peak total (MiB) "
          f"| activations vs {variants[0][0]} | step time (s) | step vs {variants[0][0]} |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for seq in a.seq:
        for ck in ckpts:
            base = results[(seq, ck, variants[0][0])]
            base_t = statistics.median(x["step_s"] for x in base)
            for name, _, _ in variants:
                rs = results[(seq, ck, name)]
                t = statistics.median(x["step_s"] for x in rs)
                x = rs[-1]
                print(f"| {seq} | {'every' if ck else 'none'} | {name} | {x['act'] / MIB:.1f} "
                      f"| {x['plan_act_mib']:.1f} | {x['act_own'] / MIB:.1f} | {x['ws'] / MIB:.1f} "
                      f"| {x['peak'] / MIB:.1f} "
                      f"| {x['act'] / base[-1]['act']:.3f} | {t:.2f} | {t / base_t:.3f} |")
    print()
    print("Step times of every round, s (variants in the order above):")
    for seq in a.seq:
        for ck in ckpts:
            rounds = [" ".join(f"{x['step_s']:.2f}" for x in results[(seq, ck, name)])
                      for name, _, _ in variants]
            print(f"- seq {seq}, checkpoint {'every' if ck else 'none'}: " + " / ".join(rounds))
    print()
    print("Per block (gpt2-124m: h = 768, a = 12 heads, b = micro_batch), bytes:")
    print("| s | today: naive, fp32 | naive, fp32 | tiled, fp32 | tiled, 16-bit "
          "| Korthikanti 34sbh + 5as^2b |")
    print("|---:|---:|---:|---:|---:|---:|")
    b, h, heads = a.micro_batch, 768, 12
    for s in a.seq:
        k = 34 * s * b * h + 5 * heads * s * s * b
        print(f"| {s} | {block_bytes(s, b, h, heads, False, kept=16) / MIB:.1f} MiB "
              f"| {block_bytes(s, b, h, heads, False) / MIB:.1f} MiB "
              f"| {block_bytes(s, b, h, heads, True) / MIB:.1f} MiB "
              f"| {block_bytes(s, b, h, heads, True, es=2) / MIB:.1f} MiB | {k / MIB:.1f} MiB |")


if __name__ == "__main__":
    main()
