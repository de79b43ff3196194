#!/usr/bin/env python3
"""CPU step time of a Llama-shaped model: headroom against transformers' LlamaForCausalLM in
PyTorch eager, the same model, batch shape, optimizer and threads (docs/results/llama.md).

    .venv-test/bin/python bench/llama/step_time.py [--build build] [--preset smollm2-135m]
        [--seq-len 256] [--micro-batch 4] [--threads 2] [--steps 4] [--rounds 3]

A random LlamaForCausalLM of the preset's shape (the table below: the shapes of headroom's
presets) is saved with save_pretrained into a temporary folder; headroom trains from it
(`[train] init_from` = the folder, the shape from its config.json), so both run the same model.
Each round runs, in turn: headroom (`train -q --metrics`), transformers with its default
attention (sdpa), transformers with attn_implementation="eager". A run's step time is the median
of its steps from step 2 on; the table gives each program's median over the rounds and
headroom's time over each (above 1: headroom is faster). The step on both sides: forward,
cross-entropy, backward, global-norm clipping at 1.0, AdamW (betas 0.9/0.95, eps 1e-8, weight
decay 0.1 on matrices only: headroom's defaults). The load average at each run's start is printed:
the machine may be shared.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import transformers

# n_layer, n_head, n_kv_head, n_embd, intermediate_size, vocab_size, tied, rope_theta
PRESETS = {
    "smollm2-135m": (30, 9, 3, 576, 1536, 49152, True, 1e5),
    "tinyllama-1.1b": (22, 32, 4, 2048, 5632, 32000, False, 1e4),
}


def make_folder(preset, seq_len, out):
    n_layer, n_head, n_kv, n_embd, inter, vocab, tied, theta = PRESETS[preset]
    config = transformers.LlamaConfig(
        num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_kv,
        hidden_size=n_embd, intermediate_size=inter, vocab_size=vocab,
        max_position_embeddings=seq_len, rms_norm_eps=1e-5, rope_theta=theta,
        tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)


def run_headroom(binary, folder, a, d):
    toml = os.path.join(d, "run.toml")
    with open(toml, "w") as f:
        f.write(f'[model]\nseq_len = {a.seq_len}\n[train]\ninit_from = "{folder}"\n'
                f"micro_batch = {a.micro_batch}\nsteps = {a.steps}\n"
                f"[device]\nthreads = {a.threads}\n")
    metrics = os.path.join(d, "m.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    subprocess.run([binary, "train", toml, "-q", "--metrics", metrics], check=True)
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [row["step_ms"] for row in rows if row["step"] >= 2]


def run_torch(folder, attn, a):
    torch.set_num_threads(a.threads)
    model = transformers.LlamaForCausalLM.from_pretrained(
        folder, attn_implementation=attn, dtype=torch.float32).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    ms = []
    for step in range(a.steps):
        tokens = torch.randint(0, vocab, (a.micro_batch, a.seq_len), generator=g)
        targets = torch.randint(0, vocab, (a.micro_batch, a.seq_len), generator=g)
        t0 = time.perf_counter()
        logits = model(input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step >= 1:
            ms.append(1000 * (time.perf_counter() - t0))
    return ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--preset", default="smollm2-135m", choices=sorted(PRESETS))
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    binary = os.path.abspath(os.path.join(a.build, "bin", "headroom"))
    progs = ["headroom", "torch eager (sdpa)", "torch eager (eager attn)"]
    times = {p: [] for p in progs}
    loads = {p: [] for p in progs}
    with tempfile.TemporaryDirectory() as d:
        folder = os.path.join(d, "model")
        make_folder(a.preset, a.seq_len, folder)
        for r in range(a.rounds):
            for p in progs:
                loads[p].append(os.getloadavg()[0])
                if p == "headroom":
                    ms = run_headroom(binary, folder, a, d)
                else:
                    ms = run_torch(folder, "sdpa" if "sdpa" in p else "eager", a)
                times[p].append(statistics.median(ms))
                print(f"round {r + 1} {p}: {times[p][-1]:.0f} ms/step (load {loads[p][-1]:.1f})",
                      file=sys.stderr, flush=True)
    t0 = statistics.median(times["headroom"])
    print(f"{a.preset}, seq_len {a.seq_len}, micro_batch {a.micro_batch}, {a.threads} threads, "
          f"{a.steps} steps (median of steps 2..), {a.rounds} rounds; torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    print("| program | ms/step | rounds (ms/step) | headroom faster | load |")
    print("| --- | ---: | --- | ---: | --- |")
    for p in progs:
        t = statistics.median(times[p])
        rounds = " ".join(f"{x:.0f}" for x in times[p])
        print(f"| {p} | {t:.0f} | {rounds} | {t / t0:.2f}x | "
              f"{min(loads[p]):.1f}-{max(loads[p]):.1f} |")


if __name__ == "__main__":
    main()
