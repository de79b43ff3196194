#!/usr/bin/env python3
"""Step time of headroom builds and PyTorch, interleaved (docs/results/cpu.md).

    bench/cpu_interleave.py CONFIG NAME=PROGRAM[@CONFIG2]... [--steps N] [--rounds R] [--set K=V]...
        [--env NAME:VAR=VALUE]...

PROGRAM is a headroom binary, or `torch:eager` / `torch:compile` (fp32), `torch:eager-bf16` /
`torch:compile-bf16` (the same under torch.autocast bf16: torch_gpt2.py --dtype bf16-autocast):
bench/torch_gpt2.py run by
--torch-python (default bench/.venv-torch/bin/python, made by bench/setup-torch-venv.sh) at the
config's model preset, seq_len and micro_batch, with fp32 AdamW, clipping at 1.0 and
torch.set_num_threads set to the threads headroom's run is given ([device] threads, else the
cores available). `@CONFIG2` runs that program on another config (a headroom binary on the
same model with amp, say); `--env NAME:VAR=VALUE` sets a variable for program NAME's runs
(HEADROOM_CPU_BF16_GEMM=0: the same binary with its bf16 GEMMs widened to f32).

Each round runs every program once, in turn (`headroom train CONFIG -q --metrics ...`), so that
what else the machine does weighs on each alike. A run's step time is the median of its steps
from step 2 on (step 1 allocates the optimizer state; torch.compile's first step compiles, so
its runs take one step more and leave out steps 1 and 2); the table gives each program's median
over the rounds and the first program's time over each (above 1: faster than the first). It also
says how far each headroom binary's losses are from the first's (max relative difference over
the steps): the unchanged-results check. The load average at each run's start is printed: the
machine may be shared.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import tomllib

HERE = os.path.dirname(os.path.abspath(__file__))


def run_headroom(binary, config, steps, sets, metrics, env=None):
    cmd = [binary, "train", config, "-q", "--metrics", metrics, "--set", f"train.steps={steps}"]
    for s in sets:
        cmd += ["--set", s]
    if os.path.exists(metrics):
        os.remove(metrics)
    subprocess.run(cmd, check=True, env=env)
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    ms = [row["step_ms"] for row in rows if row["step"] >= 2]
    return ms, [row["loss"] for row in rows], rows[0].get("backend", "(not reported)")


def shape(config, sets):
    """The preset, seq_len, micro_batch and threads the headroom run has."""
    with open(config, "rb") as f:
        c = tomllib.load(f)
    for s in sets:
        key, value = s.split("=", 1)
        table, name = key.split(".", 1)
        c.setdefault(table, {})[name] = tomllib.loads(f"v = {value}")["v"]
    model, train = c.get("model", {}), c.get("train", {})
    preset = model.get("preset", "tiny")
    seq_len = model.get("seq_len", 64 if preset == "tiny" else 1024)
    threads = c.get("device", {}).get("threads", 0) or len(os.sched_getaffinity(0))
    return preset, seq_len, train.get("micro_batch", 4), threads


def run_torch(python, mode, config, steps, sets, out):
    preset, seq_len, micro_batch, threads = shape(config, sets)
    mode, _, dtype = mode.partition("-")
    warmup = 2 if mode == "compile" else 1
    cmd = [python, os.path.join(HERE, "torch_gpt2.py"), "--device", "cpu", "--preset", preset,
           "--seq-len", str(seq_len), "--micro-batch", str(micro_batch), "--threads", str(threads),
           "--steps", str(steps + warmup - 1), "--warmup", str(warmup), "--json", out]
    if mode == "compile":
        cmd.append("--compile")
    if dtype == "bf16":
        cmd += ["--dtype", "bf16-autocast"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        res = json.load(f)
    return (res["step_ms"][warmup:], None,
            f"torch {res['torch']} {mode}{' autocast bf16' if dtype else ''}, {res['threads']} threads, AdamW {res['adamw']}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("programs", nargs="+",
                    help="NAME=PATH[@CONFIG] of a headroom binary, or NAME=torch:MODE[@CONFIG], "
                    "MODE eager, compile, eager-bf16 or compile-bf16")
    ap.add_argument("--env", action="append", default=[],
                    help="NAME:VAR=VALUE, set for program NAME's runs")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--torch-python", default=os.path.join(HERE, ".venv-torch", "bin", "python"))
    a = ap.parse_args()
    progs, configs, envs = [], {}, {}
    for p in a.programs:
        name, path = p.split("=", 1)
        path, _, config = path.partition("@")
        progs.append((name, path))
        configs[name] = config or a.config
    for e in a.env:
        name, var = e.split(":", 1)
        var, value = var.split("=", 1)
        envs.setdefault(name, dict(os.environ))[var] = value
    times = {n: [] for n, _ in progs}
    losses, backend, loads = {}, {}, {n: [] for n, _ in progs}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            for name, path in progs:
                loads[name].append(os.getloadavg()[0])
                if path.startswith("torch:"):
                    ms, loss, what = run_torch(a.torch_python, path[len("torch:"):], configs[name],
                                               a.steps, a.sets, os.path.join(d, "t.json"))
                else:
                    ms, loss, what = run_headroom(path, configs[name], a.steps, a.sets,
                                                  os.path.join(d, "m.jsonl"), envs.get(name))
                times[name].append(statistics.median(ms))
                losses[name], backend[name] = loss, what
                print(f"round {r + 1} {name}: {times[name][-1]:.1f} ms/step "
                      f"(load {loads[name][-1]:.1f})", file=sys.stderr, flush=True)
    base = progs[0][0]
    t0 = statistics.median(times[base])
    print(f"config {a.config} ({', '.join(f'{n}: {c}' for n, c in configs.items() if c != a.config) or 'all'}), "
          f"env {a.env}, steps {a.steps} (median of steps 2..), {a.rounds} rounds, "
          f"sets {a.sets}")
    print(f"{'program':<16} {'ms/step':>10} {'rounds (ms/step)':>28} {base + ' faster':>14} "
          f"{'max rel loss diff':>18} {'load':>10}  what")
    for name, _ in progs:
        t = statistics.median(times[name])
        rounds = " ".join(f"{x:.1f}" for x in times[name])
        if losses[name] is not None and losses[base] is not None:
            diff = f"{max(abs(x - y) / abs(y) for x, y in zip(losses[name], losses[base])):.2e}"
        else:
            diff = "-"
        load = f"{min(loads[name]):.1f}-{max(loads[name]):.1f}"
        print(f"{name:<16} {t:>10.1f} {rounds:>28} {t / t0:>13.2f}x {diff:>18} {load:>10}  "
              f"{backend[name]}")


if __name__ == "__main__":
    main()
