"""The transformers side of tests/hf_folder_test.cpp's parity tests (test-only; .venv-test).

    gpt2_reference.py make OUT    a random GPT2LMHeadModel (n_layer 2, n_embd 64, n_head 4,
                                  vocab 300, n_positions 64) saved with save_pretrained to
                                  OUT/single and, sharded, to OUT/sharded; a fixed batch
                                  (OUT/batch.json); its loss, every gradient
                                  (OUT/grads.safetensors, Hugging Face names and layouts) and the
                                  losses of 10 SGD steps (OUT/reference.json)
    gpt2_reference.py check OUT SAVED
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

B, T, LR, STEPS = 2, 16, 0.1, 10


def batch(out):
    with open(f"{out}/batch.json") as f:
        b = json.load(f)
    return torch.tensor(b["tokens"]), torch.tensor(b["targets"])


def loss_of(model, tokens, targets):
    logits = model(input_ids=tokens).logits
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)


def make(out):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=299, eos_token_id=299)
    model = transformers.GPT2LMHeadModel(config).float()
    # Larger than the default 0.02 init, biases and LayerNorms too: every tensor matters.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    model.save_pretrained(f"{out}/single", safe_serialization=True)
    model.save_pretrained(f"{out}/sharded", safe_serialization=True, max_shard_size="100KB")

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 300, (B, T), generator=g)
    targets = torch.randint(0, 300, (B, T), generator=g)
    targets[0, 3] = -1  # an ignored position
    with open(f"{out}/batch.json", "w") as f:
        json.dump({"tokens": tokens.tolist(), "targets": targets.tolist()}, f)

    model.zero_grad()
    loss = loss_of(model, tokens, targets)
    loss.backward()
    grads = {n: p.grad.detach().clone().contiguous() for n, p in model.named_parameters()}
    save_file(grads, f"{out}/grads.safetensors")

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


def check(out, saved):
    tokens, targets = batch(out)
    with torch.no_grad():
        ref = transformers.GPT2LMHeadModel.from_pretrained(f"{out}/single").float().eval()
        ours = transformers.GPT2LMHeadModel.from_pretrained(saved).float().eval()
        diff = (ref(input_ids=tokens).logits - ours(input_ids=tokens).logits).abs().max().item()
        scale = ref(input_ids=tokens).logits.abs().max().item()
        loss = loss_of(ours, tokens, targets).item()
    with open(f"{out}/check.json", "w") as f:
        json.dump({"max_logit_diff": diff, "max_logit": scale, "loss": loss}, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        check(sys.argv[2], sys.argv[3])
