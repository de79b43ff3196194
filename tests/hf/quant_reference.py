"""bitsandbytes' side of tests/quant_test.cpp's parity test (test-only; .venv-test).

    quant_reference.py OUT    a (1024, 1024) f32 tensor of N(0, 1) values (torch seed 0) and what
                              bitsandbytes' own CPU functions make of it, as raw little-endian
                              files in OUT: x.f32; nf4.codes, nf4.absmax, nf4.deq (quantize_4bit
                              nf4, blocksize 64, and dequantize_4bit); nf4dq.deq (the same with
                              compress_statistics: the absmaxes 8-bit); int8.codes, int8.absmax,
                              int8.deq (quantize_blockwise, blocksize 256, its dynamic map, and
                              dequantize_blockwise); int8dq.deq (nested=True); dynamic.f32
                              (create_dynamic_map(signed=True)), nf4.f32 (the NF4 table); and
                              OUT/errors.json, the mean absolute round-trip error of each.

Exit 77 (with a message) when torch or bitsandbytes cannot be imported: the test skips.
"""
import json
import os
import sys

try:
    import torch
    import bitsandbytes.functional as F
except Exception as e:  # noqa: BLE001 - any import failure means "no reference here"
    print(f"torch and bitsandbytes are not importable ({e}); install them into .venv-test")
    sys.exit(77)


def save(out, name, t):
    with open(os.path.join(out, name), "wb") as f:
        f.write(t.detach().contiguous().cpu().numpy().tobytes())


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    save(out, "x.f32", x)
    errors = {}

    q, s = F.quantize_4bit(x, quant_type="nf4", blocksize=64)
    y = F.dequantize_4bit(q, s)
    save(out, "nf4.codes", q)
    save(out, "nf4.absmax", s.absmax)
    save(out, "nf4.deq", y)
    errors["nf4"] = (x - y).abs().mean().item()

    q, s = F.quantize_4bit(x, quant_type="nf4", blocksize=64, compress_statistics=True)
    y = F.dequantize_4bit(q, s)
    save(out, "nf4dq.deq", y)
    errors["nf4dq"] = (x - y).abs().mean().item()

    q, s = F.quantize_blockwise(x, blocksize=256)
    y = F.dequantize_blockwise(q, s)
    save(out, "int8.codes", q)
    save(out, "int8.absmax", s.absmax)
    save(out, "int8.deq", y)
    errors["int8"] = (x - y).abs().mean().item()

    q, s = F.quantize_blockwise(x, blocksize=256, nested=True)
    y = F.dequantize_blockwise(q, s)
    save(out, "int8dq.deq", y)
    errors["int8dq"] = (x - y).abs().mean().item()

    save(out, "dynamic.f32", F.create_dynamic_map(signed=True))
    save(out, "nf4.f32", F.get_4bit_type("nf4", device="cpu"))
    with open(os.path.join(out, "errors.json"), "w") as f:
        json.dump(errors, f)


if __name__ == "__main__":
    main()
