#!/usr/bin/env python3
"""Step time of two or more headroom builds, interleaved (docs/results/cpu.md).

    bench/cpu_interleave.py CONFIG NAME=HEADROOM_BINARY... [--steps N] [--rounds R] [--set K=V]...

Each round runs every binary once, in turn (`headroom train CONFIG -q --metrics ...`), so that
what else the machine does weighs on each alike. A run's step time is the median of its steps
from step 2 on (step 1 allocates the optimizer state); the table gives each binary's median over
the rounds and its ratio to the first. It also says how far each binary's losses are from the
first's (max relative difference over the steps): the unchanged-results check.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run(binary, config, steps, sets, metrics):
    cmd = [binary, "train", config, "-q", "--metrics", metrics, "--set", f"train.steps={steps}"]
    for s in sets:
        cmd += ["--set", s]
    if os.path.exists(metrics):
        os.remove(metrics)
    subprocess.run(cmd, check=True)
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("binaries", nargs="+", help="NAME=PATH of a headroom binary")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    a = ap.parse_args()
    progs = [b.split("=", 1) for b in a.binaries]
    times = {n: [] for n, _ in progs}
    losses = {}
    backend = {}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            for name, path in progs:
                rows = run(path, a.config, a.steps, a.sets, os.path.join(d, "m.jsonl"))
                ms = [row["step_ms"] for row in rows if row["step"] >= 2]
                times[name].append(statistics.median(ms))
                losses[name] = [row["loss"] for row in rows]
                backend[name] = rows[0].get("backend", "(not reported)")
                print(f"round {r + 1} {name}: {times[name][-1]:.1f} ms/step", file=sys.stderr)
    base = progs[0][0]
    t0 = statistics.median(times[base])
    print(f"config {a.config}, steps {a.steps} (median of steps 2..), {a.rounds} rounds, "
          f"sets {a.sets}")
    print(f"{'program':<16} {'ms/step':>10} {'vs ' + base:>12} {'max rel loss diff':>18}  backend")
    for name, _ in progs:
        t = statistics.median(times[name])
        diff = max(abs(x - y) / abs(y) for x, y in zip(losses[name], losses[base]))
        print(f"{name:<16} {t:>10.1f} {t0 / t:>11.2f}x {diff:>18.2e}  {backend[name]}")


if __name__ == "__main__":
    main()
