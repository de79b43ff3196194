"""The PEFT side of tests/lora_test.cpp's parity test (test-only; .venv-test).

    lora_reference.py make ARCH OUT   ARCH gpt2 or llama: reference.py's random model (its base
                                      weights perturbed as there), saved to OUT/base; a PEFT
                                      LoraConfig of rank 4, alpha 8 and dropout 0 on every linear
                                      module of its blocks (GPT-2: c_attn, c_proj — attention's
                                      and the MLP's — and c_fc; Llama: q, k, v, o, gate, up and
                                      down_proj) with B drawn nonzero, so that A has a gradient
                                      too; the adapters under headroom's names
                                      (OUT/adapters.safetensors: "h.0.attn.c_attn.lora_A.weight"
                                      (r, in), lora_B (out, r)); the loss on a fixed batch
                                      (OUT/batch.json) and every adapter's gradient
                                      (OUT/lora_grads.safetensors, OUT/lora_reference.json)
    lora_reference.py check ARCH OUT SAVED
                                      OUT/base with the adapter headroom saved in PEFT's format
                                      (SAVED: adapter_model.safetensors, adapter_config.json)
                                      through PeftModel.from_pretrained: its loss on the batch
                                      (OUT/lora_check.json)
    lora_reference.py merge ARCH OUT SAVED MERGED
                                      the same, merged by PEFT's merge_and_unload, against the
                                      merged folder headroom wrote (MERGED): the largest absolute
                                      and relative difference over every tensor, and the tensors
                                      compared or missing (OUT/lora_merge.json)

Exit 77 (with a message) when torch, transformers or peft cannot be imported: the test skips.
"""
import json
import os
import sys

try:
    import torch
    import peft
    from safetensors.torch import save_file
except Exception as e:  # noqa: BLE001 - any import failure means "no reference here"
    print(f"torch, transformers and peft are not importable ({e}); install them into .venv-test")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference  # noqa: E402 - the model and batch of the transformers parity tests

RANK, ALPHA = 4, 8.0
TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"],
           "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def headroom_name(name):
    """base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight -> h.0...lora_A.weight"""
    name = name[len("base_model.model."):]
    if name.startswith("transformer."):
        name = name[len("transformer."):]
    return name.replace(".default.", ".")


def make(arch, out):
    torch.manual_seed(0)
    model = reference.new_model(arch)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    model.save_pretrained(f"{out}/base", safe_serialization=True)

    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                             target_modules=TARGETS[arch], fan_in_fan_out=arch == "gpt2")
    lora = peft.get_peft_model(model, config)
    lora.eval()
    g = torch.Generator().manual_seed(2)
    adapters = {}
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            if "lora_" in n:
                adapters[headroom_name(n)] = p.detach().clone().contiguous()
    save_file(adapters, f"{out}/adapters.safetensors")

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, reference.VOCAB, (reference.B, reference.T), generator=g)
    targets = torch.randint(0, reference.VOCAB, (reference.B, reference.T), generator=g)
    targets[0, 3] = -1  # an ignored position
    with open(f"{out}/batch.json", "w") as f:
        json.dump({"tokens": tokens.tolist(), "targets": targets.tolist()}, f)

    lora.zero_grad()
    loss = reference.loss_of(lora, tokens, targets)
    loss.backward()
    grads = {headroom_name(n): p.grad.detach().clone().contiguous()
             for n, p in lora.named_parameters() if "lora_" in n}
    frozen_with_grad = [n for n, p in lora.named_parameters() if "lora_" not in n and p.grad is not None]
    assert not frozen_with_grad, frozen_with_grad
    save_file(grads, f"{out}/lora_grads.safetensors")
    with open(f"{out}/lora_reference.json", "w") as f:
        json.dump({"loss": loss.item(), "rank": RANK, "alpha": ALPHA, "targets": TARGETS[arch],
                   "adapters": len(adapters)}, f)


def check(arch, out, saved):
    tokens, targets = reference.batch(out)
    base = reference.load(arch, f"{out}/base")
    model = peft.PeftModel.from_pretrained(base, saved).eval()
    with torch.no_grad():
        loss = reference.loss_of(model, tokens, targets).item()
    with open(f"{out}/lora_check.json", "w") as f:
        json.dump({"loss": loss}, f)


def merge(arch, out, saved, merged):
    from safetensors.torch import load_file
    base = reference.load(arch, f"{out}/base")
    model = peft.PeftModel.from_pretrained(base, saved).merge_and_unload()
    theirs = {n: t.detach() for n, t in model.state_dict().items()}
    ours = load_file(f"{merged}/model.safetensors")
    worst_abs = worst_rel = 0.0
    missing = [n for n in ours if n not in theirs]
    compared = 0
    for n, t in ours.items():
        if n in theirs:
            d = (t.double() - theirs[n].double()).abs().max().item()
            worst_abs = max(worst_abs, d)
            worst_rel = max(worst_rel, d / max(theirs[n].double().abs().max().item(), 1e-30))
            compared += 1
    with open(f"{out}/lora_merge.json", "w") as f:
        json.dump({"compared": compared, "missing": missing, "max_abs": worst_abs,
                   "max_rel": worst_rel}, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "merge":
        merge(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
    else:
        check(sys.argv[2], sys.argv[3], sys.argv[4])
