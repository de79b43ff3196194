"""The transformers side of tests/hf_folder_test.cpp's parity tests (test-only; .venv-test).

    reference.py make ARCH OUT    ARCH gpt2: a random GPT2LMHeadModel (n_layer 2, n_embd 64,
                                  n_head 4, vocab 300, n_positions 64); ARCH llama: a random
                                  LlamaForCausalLM (3 layers, hidden 64, 4 heads, 2 key/value
                                  heads, intermediate 96, vocab 300, untied head, Llama 3 rope
                                  scaling). Saved with save_pretrained to OUT/single and, sharded,
                                  to OUT/sharded; a fixed batch (OUT/batch.json); its loss, every
                                  gradient in headroom's names and layouts (OUT/grads.safetensors:
                                  GPT-2's Conv1D weights as stored, (in, out); Llama's q, k, v and
                                  gate, up stacked by rows into qkv_proj and gate_up_proj) and the
                                  losses of 10 SGD steps (OUT/reference.json)
    reference.py check ARCH OUT SAVED
                                  loads SAVED (headroom's --save-weights folder) with
                                  from_pretrained and writes OUT/check.json: its logits' largest
                                  difference from OUT/single's model, and its loss on the batch

Exit 77 (with a message) when torch or transformers cannot be imported: the test skips.
"""
import json
import sys

try:
    import torch
    import transformers
    from safetensors.torch import save_file
except Exception as e:  # noqa: BLE001 - any import failure means "no reference here"
    print(f"torch and transformers are not importable ({e}); install them into .venv-test")
    sys.exit(77)

B, T, LR, STEPS, VOCAB = 2, 16, 0.1, 10, 300


def model_class(arch):
    return transformers.GPT2LMHeadModel if arch == "gpt2" else transformers.LlamaForCausalLM


def new_model(arch):
    if arch == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=VOCAB - 1,
            eos_token_id=VOCAB - 1)
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=64,
            rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    config._attn_implementation = "eager"
    return model_class(arch)(config).float()


def load(arch, path):
    return model_class(arch).from_pretrained(path, attn_implementation="eager").float().eval()


def batch(out):
    with open(f"{out}/batch.json") as f:
        b = json.load(f)
    return torch.tensor(b["tokens"]), torch.tensor(b["targets"])


def loss_of(model, tokens, targets):
    logits = model(input_ids=tokens).logits
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)


def headroom_grads(arch, model):
    """Every gradient under headroom's parameter name, in its layout."""
    grads = {n: p.grad.detach().clone().contiguous() for n, p in model.named_parameters()}
    if arch == "gpt2":
        return {n[len("transformer."):] if n.startswith("transformer.") else n: g
                for n, g in grads.items()}
    out = {}
    for n, g in grads.items():
        if n.endswith("self_attn.q_proj.weight"):
            base = n[: -len("q_proj.weight")]
            out[base + "qkv_proj.weight"] = torch.cat(
                [g, grads[base + "k_proj.weight"], grads[base + "v_proj.weight"]]).contiguous()
        elif n.endswith("mlp.gate_proj.weight"):
            base = n[: -len("gate_proj.weight")]
            out[base + "gate_up_proj.weight"] = torch.cat(
                [g, grads[base + "up_proj.weight"]]).contiguous()
        elif not any(n.endswith(s) for s in ("k_proj.weight", "v_proj.weight", "up_proj.weight")):
            out[n] = g
    return out


def make(arch, out):
    torch.manual_seed(0)
    model = new_model(arch)
    # Larger than the default 0.02 init, biases and norms too: every tensor matters.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    model.save_pretrained(f"{out}/single", safe_serialization=True)
    model.save_pretrained(f"{out}/sharded", safe_serialization=True, max_shard_size="100KB")

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (B, T), generator=g)
    targets = torch.randint(0, VOCAB, (B, T), generator=g)
    targets[0, 3] = -1  # an ignored position
    with open(f"{out}/batch.json", "w") as f:
        json.dump({"tokens": tokens.tolist(), "targets": targets.tolist()}, f)

    model.zero_grad()
    loss = loss_of(model, tokens, targets)
    loss.backward()
    save_file(headroom_grads(arch, model), f"{out}/grads.safetensors")

    losses = []
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        step_loss = loss_of(model, tokens, targets)
        losses.append(step_loss.item())
        step_loss.backward()
        opt.step()
    with open(f"{out}/reference.json", "w") as f:
        json.dump({"loss": loss.item(), "sgd_losses": losses, "lr": LR}, f)


def check(arch, out, saved):
    tokens, targets = batch(out)
    with torch.no_grad():
        ref = load(arch, f"{out}/single")
        ours = load(arch, saved)
        diff = (ref(input_ids=tokens).logits - ours(input_ids=tokens).logits).abs().max().item()
        scale = ref(input_ids=tokens).logits.abs().max().item()
        loss = loss_of(ours, tokens, targets).item()
    with open(f"{out}/check.json", "w") as f:
        json.dump({"max_logit_diff": diff, "max_logit": scale, "loss": loss}, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3])
    else:
        check(sys.argv[2], sys.argv[3], sys.argv[4])
