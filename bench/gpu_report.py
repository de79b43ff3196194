#!/usr/bin/env python3
"""The tables of docs/results/gpu.md and the GPU half of docs/results/allocator.md, from what
`scripts/gpu-check run` left in its log folder (logs.tar.gz, unpacked).

    python3 bench/gpu_report.py DIR [--md FILE] [--json FILE]

Training: tokens/s over the steps after the first --warmup (3), the peak of headroom's memory
tracker against torch.cuda.max_memory_allocated (both count live buffer bytes; PyTorch's reserved
and the GPU's used memory from nvidia-smi, sampled every 100 ms above the idle reading, are
shown beside them), and the ratio headroom / PyTorch for the matching precision. MFU counts
6N + 6·L·C·T FLOPs per token (N parameters, L layers, width C, context T: the weight matmuls
forward and backward plus attention's QK^T and AV over the causal half) against the best bf16
GEMM rate bench_gemm_rate measured on the same card, for fp32 runs too: the card's ceiling.

Allocators: `headroom replay` of the trace with cudaMalloc/cudaFree, defrag_allocator and
defrag_allocator without expandable segments, and bench/torch_replay.py's PyTorch caching
allocator with and without expandable segments, under the trace's memory_limit and with none.

Standard library only: it runs anywhere the logs are.
"""

import argparse
import json
import os
import re
import sys

# The benchmark's model (bench/gpt2-124m-gpu.toml); the PyTorch results carry their own.
GPT2_124M = {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257, "seq_len": 1024,
             "micro_batch": 8}


def n_params(m):
    L, C, V, T = m["n_layer"], m["n_embd"], m["vocab_size"], m["seq_len"]
    return V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C


def flops_per_token(m):
    return 6 * n_params(m) + 6 * m["n_layer"] * m["n_embd"] * m["seq_len"]


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_text(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return None


def gib(b):
    if b is None:
        return "—"
    return f"{b / (1 << 30):.2f} GiB" if b >= (1 << 30) else f"{b / (1 << 20):.1f} MiB"


def mib(b):
    return "—" if b is None else f"{b / (1 << 20):.1f} MiB"


def num(x, fmt):
    return "—" if x is None else fmt.format(x)


def pct(x, fmt="{:.1f}%"):
    return "—" if x is None else fmt.format(100 * x)


def steps_status(d):
    """{step: (status word, seconds, full status)} from steps.tsv."""
    out = {}
    text = read_text(os.path.join(d, "steps.tsv")) or ""
    for line in text.splitlines():
        f = line.split("\t")
        if len(f) >= 3:
            out[f[0]] = (f[1], f[2], f[3] if len(f) > 3 else f[1])
    return out


def gpu_mem_used(d, name):
    """Bytes the GPU's used memory rose above its lowest sample (the idle reading the sampler
    takes before the step starts) while step `name` ran."""
    text = read_text(os.path.join(d, name + ".mem"))
    if not text:
        return None
    vals = []
    for line in text.splitlines():
        try:
            vals.append(float(line.strip().split(",")[0]))
        except ValueError:
            pass
    if len(vals) < 2:
        return None
    return (max(vals) - min(vals)) * (1 << 20)


def headroom_train(d, name, warmup):
    lines = []
    for line in (read_text(os.path.join(d, name + ".jsonl")) or "").splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            pass
    if not lines:
        return None
    timed = [r for r in lines if r.get("step", 0) > warmup] or lines
    secs = sum(r["step_ms"] for r in timed) / 1e3
    tokens = sum(r["tokens_per_s"] * r["step_ms"] / 1e3 for r in timed)
    ms = sorted(r["step_ms"] for r in timed)
    last = lines[-1]
    return {
        "steps": len(lines), "timed_steps": len(timed),
        "tokens_per_s": tokens / secs if secs > 0 else None,
        "step_ms_median": ms[len(ms) // 2],
        "mem_peak_bytes": last.get("mem_peak_bytes"),
        "mem_peak_by_category": last.get("mem_peak_by_category"),
        "skipped_steps": last.get("skipped_steps", 0),
        "loss_first": lines[0].get("loss"), "loss_last": last.get("loss"),
    }


RE_REPLAY = {
    "allocator": re.compile(r"^  allocator\s+(\S.*)$", re.M),
    "memory_limit": re.compile(r"^  memory_limit\s+(\S.*)$", re.M),
    "allocations": re.compile(r"^  allocations\s+(\d+)", re.M),
    "peak_reserved": re.compile(r"^  peak reserved\s+.*\((\d+) bytes\)", re.M),
    "fragmentation": re.compile(r"^  fragmentation\s+([0-9.]+)%", re.M),
    "allocs_per_s": re.compile(r"^  speed\s+([0-9.e+-]+) allocations/s", re.M),
    "failed": re.compile(r"^  FAILED at seq (\d+).*?: (\S+ \S+)", re.M),
}


def headroom_replay(d, name):
    text = read_text(os.path.join(d, name + ".log"))
    if not text or "replay of" not in text:
        return None
    r = {}
    for key, rx in RE_REPLAY.items():
        m = rx.search(text)
        r[key] = m.group(1) if m else None
    if r["allocations"] is None:  # stopped before the replay ran (no device, bad config)
        return None
    fm = RE_REPLAY["failed"].search(text)
    r["completed"] = fm is None
    r["failure"] = f"seq {fm.group(1)}, {fm.group(2)}" if fm else None
    for key in ("allocations", "peak_reserved"):
        r[key] = int(r[key]) if r[key] else None
    for key in ("fragmentation", "allocs_per_s"):
        r[key] = float(r[key]) if r[key] else None
    if r["fragmentation"] is not None:
        r["fragmentation"] /= 100
    return r


def device_line(d):
    text = read_text(os.path.join(d, "env.log")) or ""
    lines = text.splitlines()
    info = {}
    for i, line in enumerate(lines):
        if line.startswith("name, driver_version") and i + 1 < len(lines):
            info["gpu"] = lines[i + 1].strip()
        elif line.startswith("# date:"):
            info["date"] = line.split(":", 1)[1].strip()
        elif line.startswith("commit="):
            info["bundle_commit"] = line.split("=", 1)[1].strip()
        elif line.startswith("describe="):
            info["bundle_describe"] = line.split("=", 1)[1].strip()
        elif line.startswith("torch ") and "cuda" in line:
            info["torch"] = line.strip()
    return info


def build(d, warmup):
    st = steps_status(d)
    res = {"device": device_line(d), "steps": {k: v[2] for k, v in st.items()}}

    def status(name):
        s = st.get(name)
        if s is None:
            return "not run"
        return "ok" if s[0] == "ok" else s[2]

    gemm = read_json(os.path.join(d, "gemm.json"))
    peak = gemm.get("bf16_peak_tflops") if gemm else None
    res["gemm"] = gemm
    res["bf16_peak_tflops"] = peak

    torch_rows = {}
    for name in ("torch-fp32", "torch-bf16", "torch-fp32-sdpa", "torch-bf16-sdpa",
                 "torch-bf16-params"):
        j = read_json(os.path.join(d, name + ".json"))
        torch_rows[name] = j
    model = dict(GPT2_124M)
    for j in torch_rows.values():
        if j:
            model = {k: j[k] for k in GPT2_124M}
            break
    fpt = flops_per_token(model)
    res["model"] = dict(model, params=n_params(model), flops_per_token=fpt)

    def mfu(tps):
        return tps * fpt / (peak * 1e12) if tps and peak else None

    train = []
    labels = {
        "hr-fp32": ("headroom", "fp32", "explicit (B,NH,T,T)", "torch-fp32"),
        "hr-bf16": ("headroom + amp", "bf16 storage", "explicit (B,NH,T,T)", "torch-bf16"),
        "hr-fp32-defrag": ("headroom + defrag_allocator", "fp32", "explicit (B,NH,T,T)",
                           "torch-fp32"),
        "hr-bf16-defrag": ("headroom + amp + defrag_allocator", "bf16 storage",
                           "explicit (B,NH,T,T)", "torch-bf16"),
        "torch-fp32": ("PyTorch eager", "fp32", "explicit (B,NH,T,T)", None),
        "torch-bf16": ("PyTorch eager", "bf16 autocast", "explicit (B,NH,T,T)", None),
        "torch-fp32-sdpa": ("PyTorch eager", "fp32", "SDPA", None),
        "torch-bf16-sdpa": ("PyTorch eager", "bf16 autocast", "SDPA", None),
        "torch-bf16-params": ("PyTorch eager", "bf16 params + AdamW state", "explicit (B,NH,T,T)",
                              None),
    }
    for name, (who, dtype, attn, ref) in labels.items():
        row = {"step": name, "run": who, "dtype": dtype, "attention": attn,
               "status": status(name), "gpu_mem_used_bytes": gpu_mem_used(d, name)}
        if name.startswith("hr-"):
            h = headroom_train(d, name, warmup)
            if h:
                row.update(tokens_per_s=h["tokens_per_s"], step_ms_median=h["step_ms_median"],
                           mem_peak_bytes=h["mem_peak_bytes"], mem_reserved_bytes=None,
                           mem_peak_by_category=h["mem_peak_by_category"],
                           skipped_steps=h["skipped_steps"], loss_first=h["loss_first"],
                           loss_last=h["loss_last"])
        else:
            j = torch_rows.get(name)
            if j:
                row.update(tokens_per_s=j["tokens_per_s"], step_ms_median=j["step_ms_median"],
                           mem_peak_bytes=j.get("mem_peak_allocated_bytes"),
                           mem_reserved_bytes=j.get("mem_peak_reserved_bytes"),
                           loss_first=j.get("loss_first"), loss_last=j.get("loss_last"),
                           torch=j.get("torch"), adamw=j.get("adamw"))
        row["mfu"] = mfu(row.get("tokens_per_s"))
        if ref:
            r = torch_rows.get(ref)
            row["vs"] = ref
            row["tokens_ratio"] = (row["tokens_per_s"] / r["tokens_per_s"]
                                   if r and row.get("tokens_per_s") else None)
            row["mem_ratio"] = (row["mem_peak_bytes"] / r["mem_peak_allocated_bytes"]
                                if r and row.get("mem_peak_bytes") and
                                r.get("mem_peak_allocated_bytes") else None)
        train.append(row)
    res["train"] = train

    replay = []
    for limit_key, suffix in (("trace", ""), ("none", "-64g")):
        hr_base = None
        for name, label in (("hr-replay-cuda", "headroom: cudaMalloc / cudaFree (default)"),
                            ("hr-replay-defrag", "headroom: defrag_allocator, expandable"),
                            ("hr-replay-defrag-fixed", "headroom: defrag_allocator, fixed")):
            r = headroom_replay(d, name + suffix)
            row = {"limit": limit_key, "allocator": label, "status": status(name + suffix)}
            if r:
                row.update(completed=r["completed"], allocs_per_s=r["allocs_per_s"],
                           peak_reserved=r["peak_reserved"], fragmentation=r["fragmentation"],
                           failure=r["failure"], memory_limit=r["memory_limit"])
                if name == "hr-replay-cuda":
                    hr_base = r["allocs_per_s"]
            replay.append(row)
        for name, conf in (("torch-replay", "default"),
                           ("torch-replay-expandable", "expandable segments")):
            j = read_json(os.path.join(d, name + ".json"))
            results = (j or {}).get("results", [])
            want = [x for x in results if (x["memory_limit"] != 0) == (limit_key == "trace")]
            for mode in ("cold", "warm"):
                row = {"limit": limit_key, "status": status(name),
                       "allocator": f"PyTorch caching allocator, {conf}, {mode}"}
                if want:
                    x = want[0]
                    row.update(completed=x["completed"], allocs_per_s=x[f"allocs_per_s_{mode}"],
                               peak_reserved=x["peak_reserved"],
                               fragmentation=x["fragmentation"],
                               python_loop_ns=x.get("python_loop_ns"),
                               failure=(f"seq {x['failure']['seq']}, "
                                        f"{mib(x['failure']['requested'])}"
                                        if not x["completed"] else None))
                replay.append(row)
        for row in replay:
            if row["limit"] == limit_key:
                row["vs_cudamalloc"] = (row["allocs_per_s"] / hr_base
                                        if hr_base and row.get("allocs_per_s") else None)
    res["replay"] = replay
    return res


def markdown(res, warmup):
    out = []
    dev = res["device"]
    m = res["model"]
    out.append(f"Device: {dev.get('gpu', '(unknown: no nvidia-smi query in env.log)')}  ")
    out.append(f"Run: {dev.get('date', '?')}; bundle built from "
               f"{dev.get('bundle_describe', dev.get('bundle_commit', '?'))}; "
               f"{dev.get('torch', 'torch ?')}")
    out.append("")
    name = "gpt2-124m" if all(m[k] == GPT2_124M[k] for k in ("n_layer", "n_embd", "vocab_size")) \
        else f"GPT-2 L{m['n_layer']} C{m['n_embd']} V{m['vocab_size']}"
    out.append(f"### Training: {name}, seq_len {m['seq_len']}, micro_batch {m['micro_batch']} "
               f"({m['seq_len'] * m['micro_batch']} tokens a step)")
    out.append("")
    peak = res.get("bf16_peak_tflops")
    out.append(f"N = {m['params']:,} parameters; {m['flops_per_token'] / 1e9:.3f} GFLOP per "
               f"token (6N + 6·L·C·T); MFU against the measured bf16 GEMM rate "
               f"{'%.0f TFLOP/s' % peak if peak else '(not measured)'}. tokens/s over the steps "
               f"after the first {warmup}. Peak = headroom's tracker / "
               f"torch.cuda.max_memory_allocated (reserved in brackets); GPU = nvidia-smi's "
               f"used memory above idle, sampled every 100 ms (CUDA context included).")
    out.append("")
    out.append("| run | storage | attention | tokens/s | step ms | peak memory | GPU | MFU | "
               "tokens/s vs PyTorch | memory vs PyTorch |")
    out.append("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in res["train"]:
        if r["status"] != "ok" and not r.get("tokens_per_s"):
            out.append(f"| {r['run']} | {r['dtype']} | {r['attention']} | {r['status']} "
                       f"| | | | | | |")
            continue
        peak_mem = gib(r.get("mem_peak_bytes"))
        if r.get("mem_reserved_bytes"):
            peak_mem += f" ({gib(r['mem_reserved_bytes'])})"
        tps = r.get("tokens_per_s")
        cells = [r["run"], r["dtype"], r["attention"], num(tps, "{:,.0f}"),
                 num(r.get("step_ms_median"), "{:.1f}"), peak_mem,
                 gib(r.get("gpu_mem_used_bytes")), pct(r.get("mfu")),
                 num(r.get("tokens_ratio"), "{:.2f}x") if "vs" in r else "",
                 num(r.get("mem_ratio"), "{:.2f}x") if "vs" in r else ""]
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    hr_rows = [r for r in res["train"] if r["step"].startswith("hr-") and
               r.get("mem_peak_by_category")]
    if hr_rows:
        cats = list(hr_rows[0]["mem_peak_by_category"])
        out.append("headroom's peak by category:")
        out.append("")
        out.append("| run | " + " | ".join(cats) + " |")
        out.append("| --- |" + " ---: |" * len(cats))
        for r in hr_rows:
            by = r["mem_peak_by_category"]
            out.append(f"| {r['run']} ({r['dtype']}) | " +
                       " | ".join(gib(by.get(c)) for c in cats) + " |")
        out.append("")

    gemm = res.get("gemm")
    out.append("### cuBLASLt GEMM rate (bench_gemm_rate)")
    out.append("")
    if gemm:
        out.append("| GEMM | type | m | n | k | ms | TFLOP/s | check (rel. err) |")
        out.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
        for g in gemm["results"]:
            chk = f"{g['rel_err']:.1e}" if g["ok"] else f"FAILED {g['error']}"
            out.append(f"| {g['name']} | {g['dtype']} | {g['m']} | {g['n']} | {g['k']} | "
                       f"{g['median_ms']:.4f} | {g['tflops']:.1f} | {chk} |")
    else:
        out.append(f"not measured ({res['steps'].get('gemm', 'not run')})")
    out.append("")

    out.append("### Allocators: tests/data/varlen.trace (942 allocations)")
    for limit_key, title in (("trace", "under the trace's memory_limit (123 MiB)"),
                             ("none", "no pressure (headroom: --memory-limit 64GiB; "
                                      "PyTorch: no cap)")):
        out.append("")
        out.append(f"{title}:")
        out.append("")
        out.append("| allocator | completed | allocs/s | vs cudaMalloc | peak reserved | "
                   "fragmentation |")
        out.append("| --- | --- | ---: | ---: | ---: | ---: |")
        for r in res["replay"]:
            if r["limit"] != limit_key:
                continue
            if r.get("completed") is None:
                out.append(f"| {r['allocator']} | {r['status']} | | | | |")
                continue
            done = "yes" if r["completed"] else f"no ({r['failure']})"
            cells = [r["allocator"], done, num(r.get("allocs_per_s"), "{:,.0f}"),
                     num(r.get("vs_cudamalloc"), "{:.2f}x"), mib(r.get("peak_reserved")),
                     pct(r.get("fragmentation"), "{:.2f}%")]
            out.append("| " + " | ".join(cells) + " |")
    loop = [r.get("python_loop_ns") for r in res["replay"] if r.get("python_loop_ns")]
    if loop:
        out.append("")
        out.append(f"PyTorch's rows are a Python loop over torch.cuda.caching_allocator_alloc / "
                   f"caching_allocator_delete; the same loop over no-op functions takes "
                   f"{loop[0]:.0f} ns per call, which those rates include.")
    out.append("")
    out.append("### Steps")
    out.append("")
    out.append("| step | status |")
    out.append("| --- | --- |")
    for k, v in res["steps"].items():
        out.append(f"| {k} | {v} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="gpu-check's log folder (logs.tar.gz unpacked)")
    p.add_argument("--warmup", type=int, default=3, help="headroom steps left out of tokens/s")
    p.add_argument("--md", help="write the markdown here too")
    p.add_argument("--json", help="write every number here")
    args = p.parse_args(argv)
    if not os.path.isdir(args.dir):
        print(f"gpu_report: {args.dir} is not a folder", file=sys.stderr)
        return 2
    res = build(args.dir, args.warmup)
    md = markdown(res, args.warmup)
    sys.stdout.write(md)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
