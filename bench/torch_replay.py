#!/usr/bin/env python3
"""Replays a headroom allocation trace against PyTorch's CUDA caching allocator.

    python3 bench/torch_replay.py tests/data/varlen.trace --json FILE
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/torch_replay.py ...
    python3 bench/torch_replay.py tests/data/varlen.trace --dry-run     (no torch, no GPU)

The PyTorch half of docs/results/allocator.md's GPU comparison: the same allocations and frees,
in the same order, as `headroom replay` runs against cudaMalloc/cudaFree and defrag_allocator,
through torch.cuda.caching_allocator_alloc / caching_allocator_delete. PYTORCH_CUDA_ALLOC_CONF is
read once, when CUDA starts, so with and without expandable segments are two processes.

Each trace is replayed under its recorded memory_limit (torch.cuda.set_per_process_memory_fraction
caps what the caching allocator may reserve, as headroom's memory_limit caps the device) and with
no cap. Per setting, as headroom's replay does:
  - one measuring pass: completed or the first allocation that failed; peak reserved
    (torch.cuda.memory_reserved after each allocation) and fragmentation, the share of the peak
    reserved bytes not live in the trace at that moment;
  - cold passes, timed: every pass starts from an empty cache (torch.cuda.empty_cache() between
    passes, untimed), as each timed pass of `headroom replay` starts a fresh allocator; allocs/s
    is the trace's allocations over the time of all its allocation and free calls;
  - warm passes, timed: the cache kept from the pass before: a training loop's steady state.
The loop is Python: each call also pays the interpreter and the binding; the per-call time of the
same loop over a no-op function is printed (python_loop_ns) so the reader can see how much.

The trace format is core/report/alloc_trace.h's (version 1); this reader checks it as strictly.
"""

import argparse
import json
import os
import sys
import time

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "workspace",
              "communication", "data", "reserved")


class TraceError(Exception):
    pass


class Trace:
    def __init__(self):
        self.path = ""
        self.memory_limit = 0
        self.device = "cpu"
        self.version = ""
        self.records = []  # (is_alloc, id, bytes)
        self.num_allocs = 0
        self.num_frees = 0
        self.peak_live = 0


def parse_trace(path):
    """Reads and checks a trace as core/report/alloc_trace.cpp does; TraceError 'FILE:LINE: what'."""
    t = Trace()
    t.path = path
    with open(path, "rb") as f:
        data = f.read().decode("utf-8", errors="replace")
    if data and not data.endswith("\n"):
        raise TraceError(f"{path}: truncated: the last line has no newline")
    lines = data.split("\n")[:-1] if data else []
    if not lines:
        raise TraceError(f"{path}:1: empty file: not an allocation trace")

    def fail(n, what):
        return TraceError(f"{path}:{n}: {what}")

    head = lines[0].rstrip("\r").split(" ")
    if len(head) < 2 or head[0] != "headroom-alloc-trace":
        raise fail(1, "not an allocation trace: the first line must start with "
                      "'headroom-alloc-trace 1'")
    if head[1] != "1":
        raise fail(1, f"trace format '{head[1]}' is not one this reader knows (1)")
    for field in head[2:]:
        key, eq, value = field.partition("=")
        if not eq:
            raise fail(1, f"header field '{field}' is not key=value")
        if key == "memory_limit":
            if not value.isdigit():
                raise fail(1, f"memory_limit '{value}' is not a byte count")
            t.memory_limit = int(value)
        elif key == "device":
            t.device = value
        elif key == "version":
            t.version = lines[0].split("version=", 1)[1].rstrip("\r")
            break
        else:
            raise fail(1, f"unknown header field '{key}'")

    live = {}
    live_bytes = 0
    ended = False
    for n, line in enumerate(lines[1:], start=2):
        line = line.rstrip("\r")
        if not line or line[0] == "#":
            continue
        if ended:
            raise fail(n, "a record after the end line (E)")
        if len(line) < 2 or line[1] != " ":
            raise fail(n, f"bad record '{line}'")
        op = line[0]
        if op == "P":
            continue
        f = line.split(" ")
        if op == "E":
            if len(f) != 4 or not all(x.isdigit() for x in f[1:]):
                raise fail(n, f"bad end line '{line}'")
            counts = tuple(int(x) for x in f[1:])
            if counts != (len(t.records), t.num_allocs, t.num_frees):
                raise fail(n, f"the end line counts {counts} but the file holds "
                              f"{(len(t.records), t.num_allocs, t.num_frees)}")
            ended = True
            continue
        if op not in "AF":
            raise fail(n, f"unknown record type '{op}'; valid: P, A, F, E")
        if len(f) != 6 or not all(x.isdigit() for x in (f[1], f[2], f[3], f[5])):
            raise fail(n, f"bad record '{line}'")
        seq, ident, nbytes = int(f[1]), int(f[2]), int(f[3])
        if f[4] not in CATEGORIES:
            raise fail(n, f"unknown category '{f[4]}'")
        if seq != len(t.records):
            raise fail(n, f"seq {seq} out of order: expected {len(t.records)}")
        if op == "A":
            if ident == 0:
                raise fail(n, "allocation id 0: ids start at 1")
            if ident in live:
                raise fail(n, f"allocation id {ident} is already live")
            live[ident] = (nbytes, f[4])
            live_bytes += nbytes
            t.peak_live = max(t.peak_live, live_bytes)
            t.num_allocs += 1
        else:
            if ident not in live:
                raise fail(n, f"free of id {ident}, which is not live")
            if live[ident] != (nbytes, f[4]):
                raise fail(n, f"free of id {ident} as {nbytes} bytes of {f[4]}; it was "
                              f"allocated as {live[ident][0]} bytes of {live[ident][1]}")
            live_bytes -= nbytes
            del live[ident]
            t.num_frees += 1
        t.records.append((op == "A", ident, nbytes))
    if not ended:
        raise TraceError(f"{path}:{len(lines)}: truncated: no end line (E) after the last record")
    return t


def compile_replay(trace):
    """(is_alloc, slot, bytes, live_after) per record: a dense slot per live buffer, so the timed
    loop indexes a list instead of hashing ids (as core/report/alloc_trace.cpp's replay does)."""
    slot_of, free_slots, out = {}, [], []
    num_slots, live = 0, 0
    for is_alloc, ident, nbytes in trace.records:
        if is_alloc:
            if free_slots:
                s = free_slots.pop()
            else:
                s, num_slots = num_slots, num_slots + 1
            slot_of[ident] = s
            live += nbytes
        else:
            s = slot_of.pop(ident)
            free_slots.append(s)
            live -= nbytes
        out.append((is_alloc, s, nbytes, live))
    return out, num_slots


class FakeAllocator:
    """A stand-in for the caching allocator with a byte cap: checks this script without a GPU."""

    class OutOfMemory(Exception):
        pass

    def __init__(self):
        self.limit = None
        self.live = 0
        self.sizes = {}
        self.next = 1 << 20

    def alloc(self, nbytes):
        if self.limit is not None and self.live + nbytes > self.limit:
            raise FakeAllocator.OutOfMemory(f"{nbytes} bytes over the cap {self.limit}")
        p = self.next
        self.next += max(nbytes, 1) + 512
        self.sizes[p] = nbytes
        self.live += nbytes
        return p

    def free(self, p):
        self.live -= self.sizes.pop(p)

    def reserved(self):
        return self.live

    def empty_cache(self):
        pass

    def set_limit(self, limit):
        self.limit = limit


class TorchAllocator:
    def __init__(self, torch):
        self.torch = torch
        self.alloc = torch.cuda.caching_allocator_alloc
        self.free = torch.cuda.caching_allocator_delete
        # An allocation over the cap raises OutOfMemoryError; any other RuntimeError from the
        # allocator is caught as a failure too (its message is kept), so that one odd call
        # does not lose the other settings' results.
        self.OutOfMemory = (torch.cuda.OutOfMemoryError, RuntimeError)
        self.total = torch.cuda.get_device_properties(0).total_memory

    def reserved(self):
        return self.torch.cuda.memory_reserved()

    def empty_cache(self):
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()

    def set_limit(self, limit):
        # A fraction of the card: the caching allocator refuses to reserve past it.
        self.torch.cuda.set_per_process_memory_fraction(
            1.0 if limit is None else min(1.0, limit / self.total))


def measure_pass(a, recs, num_slots):
    """The measuring pass: completion, peak reserved and the live bytes then."""
    ptrs = [0] * num_slots
    r = {"completed": True, "allocations": 0, "peak_reserved": 0, "live_at_peak_reserved": 0}
    i = 0
    try:
        for i, (is_alloc, s, nbytes, live) in enumerate(recs):
            if is_alloc:
                ptrs[s] = a.alloc(nbytes)
                r["allocations"] += 1
                reserved = a.reserved()
                if reserved > r["peak_reserved"]:
                    r["peak_reserved"], r["live_at_peak_reserved"] = reserved, live
            else:
                a.free(ptrs[s])
                ptrs[s] = 0
    except a.OutOfMemory as e:
        is_alloc, s, nbytes, live = recs[i]
        r["completed"] = False
        r["failure"] = {"seq": i, "requested": nbytes, "live": live - nbytes,
                        "reserved": a.reserved(), "error": str(e).split("\n")[0][:300]}
    for p in ptrs:
        if p:
            a.free(p)
    pr = r["peak_reserved"]
    r["fragmentation"] = (pr - min(pr, r["live_at_peak_reserved"])) / pr if pr else 0.0
    a.empty_cache()
    return r


def one_pass(a, recs, num_slots):
    """One replay: (seconds of the allocation and free calls, allocations served). Buffers still
    live at the end (or at a failure) are freed after the clock stops."""
    alloc, free = a.alloc, a.free
    ptrs = [0] * num_slots
    n = 0
    t0 = time.perf_counter()
    try:
        for is_alloc, s, nbytes, _ in recs:
            if is_alloc:
                ptrs[s] = alloc(nbytes)
                n += 1
            else:
                free(ptrs[s])
                ptrs[s] = 0
    except a.OutOfMemory:
        pass  # timed up to the failure, as headroom's replay
    seconds = time.perf_counter() - t0
    for p in ptrs:
        if p:
            free(p)
    return seconds, n


def timed_passes(a, recs, num_slots, min_seconds, warm):
    """allocs/s over passes adding up to min_seconds: cold (an empty cache before each pass) or
    warm (the cache the pass before left)."""
    a.empty_cache()
    if warm:
        one_pass(a, recs, num_slots)  # untimed: fills the cache
    seconds, allocations, passes = 0.0, 0, 0
    while passes == 0 or (seconds < min_seconds and passes < 10000):
        dt, n = one_pass(a, recs, num_slots)
        seconds += dt
        allocations += n
        passes += 1
        if not warm:
            a.empty_cache()
    a.empty_cache()
    return {"allocs_per_s": allocations / seconds if seconds > 0 else 0.0,
            "seconds": seconds, "passes": passes}


def python_loop_ns(recs, num_slots):
    """ns per record of the same loop calling no-op functions: the interpreter's share."""
    def alloc(n):
        return 1

    def free(p):
        pass

    best = None
    for _ in range(5):
        ptrs = [0] * num_slots
        t0 = time.perf_counter()
        for is_alloc, s, nbytes, _ in recs:
            if is_alloc:
                ptrs[s] = alloc(nbytes)
            else:
                free(ptrs[s])
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return 1e9 * best / max(1, len(recs))


def fmt_bytes(n):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="allocation traces (headroom train --record-allocs)")
    p.add_argument("--dry-run", action="store_true",
                   help="parse and check the traces, print their counts; no torch, no GPU")
    p.add_argument("--fake", action="store_true",
                   help="replay against a Python stand-in allocator (checks this script; no GPU)")
    p.add_argument("--min-seconds", type=float, default=0.5, help="timed replay per measurement")
    p.add_argument("--json", help="write the results to FILE")
    args = p.parse_args(argv)

    try:
        traces = [parse_trace(path) for path in args.traces]
    except (TraceError, OSError) as e:
        print(f"torch_replay: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        for t in traces:
            print(f"{t.path}: {len(t.records)} records, {t.num_allocs} allocations, "
                  f"{t.num_frees} frees, peak live {t.peak_live} bytes ({fmt_bytes(t.peak_live)}),"
                  f" memory_limit {t.memory_limit} ({fmt_bytes(t.memory_limit)}), recorded by "
                  f"{t.version or '(unknown)'} on {t.device}")
        return 0

    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if args.fake:
        a, info = FakeAllocator(), {"allocator": "fake (no GPU)"}
    else:
        import torch
        if not torch.cuda.is_available():
            print("torch_replay: no CUDA device (--dry-run or --fake check the script without one)",
                  file=sys.stderr)
            return 2
        torch.cuda.init()
        a = TorchAllocator(torch)
        info = {"allocator": "torch caching allocator", "torch": torch.__version__,
                "device": torch.cuda.get_device_name(0), "total_memory": a.total}
    info["PYTORCH_CUDA_ALLOC_CONF"] = conf
    out = dict(info, results=[])
    label = "expandable segments" if "expandable_segments:true" in conf.lower() else "default"
    print(f"{info['allocator']} ({label}; PYTORCH_CUDA_ALLOC_CONF={conf or 'unset'})")
    for t in traces:
        recs, num_slots = compile_replay(t)
        loop_ns = python_loop_ns(recs, num_slots)
        # Under the recorded limit (when there is one), then with no cap.
        for limit in ([t.memory_limit] if t.memory_limit else []) + [None]:
            a.set_limit(limit)
            m = measure_pass(a, recs, num_slots)
            cold = timed_passes(a, recs, num_slots, args.min_seconds, warm=False)
            warm = timed_passes(a, recs, num_slots, args.min_seconds, warm=True)
            a.set_limit(None)
            r = dict(trace=t.path, memory_limit=limit or 0, allocations_in_trace=t.num_allocs,
                     peak_live=t.peak_live, python_loop_ns=loop_ns, **m,
                     allocs_per_s_cold=cold["allocs_per_s"], passes_cold=cold["passes"],
                     allocs_per_s_warm=warm["allocs_per_s"], passes_warm=warm["passes"])
            out["results"].append(r)
            where = f"memory_limit {fmt_bytes(limit)}" if limit else "no cap"
            line = (f"  {t.path}, {where}: completed {'yes' if m['completed'] else 'no'}, "
                    f"{r['allocs_per_s_cold']:,.0f} allocs/s cold, "
                    f"{r['allocs_per_s_warm']:,.0f} warm, peak reserved "
                    f"{fmt_bytes(m['peak_reserved'])}, fragmentation "
                    f"{100 * m['fragmentation']:.2f}%")
            if not m["completed"]:
                fl = m["failure"]
                line += (f"\n    FAILED at seq {fl['seq']}: {fmt_bytes(fl['requested'])} with "
                         f"{fmt_bytes(fl['live'])} live, {fmt_bytes(fl['reserved'])} reserved")
            print(line)
        print(f"  (the Python loop alone: {loop_ns:.0f} ns per record)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
