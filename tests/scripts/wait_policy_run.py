# test_wait_policy_changes_no_number runs this once with each OMP_WAIT_POLICY: a tiny GPT's
# gradients and samples, saved to argv[1] (tests/test_hardware.py)
import plumbing, sys, torch
from model import GPT, GPTConfig
torch.manual_seed(0)
model = GPT(GPTConfig(block_size=64, vocab_size=97, n_layer=2, n_head=4, n_embd=128))
x = torch.randint(0, 97, (8, 64))
_, loss = model(x, x)
loss.backward()
tokens, logp = model.generate(x[:, :8], 16, num_samples=2, generator=torch.Generator().manual_seed(1))
torch.save({'grads': [p.grad for p in model.parameters()], 'tokens': tokens, 'logp': logp}, sys.argv[1])
