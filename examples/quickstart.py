import numpy as np

from ferro_backend import init_from_env
from ferro_fsdp import FSDP, nn, optim

backend = init_from_env()                      # ferrorun's job (shm on one host), else one rank
model = nn.Sequential(nn.Linear(16, 64, rng=0), nn.ReLU(), nn.Linear(64, 1, rng=1))
fsdp = FSDP(model, backend, "full_shard")      # each rank keeps 1/world of the parameters
opt = optim.SGD(fsdp.module.parameters(), lr=0.05, momentum=0.9)
x = np.random.default_rng(backend.rank).standard_normal((64, 16)).astype(np.float32)
y, loss_fn, losses = x.sum(axis=1, keepdims=True), nn.MSELoss(), []
for _ in range(300):
    losses.append(loss_fn(fsdp(x), y))         # all-gather, forward, free
    fsdp.backward(loss_fn.backward())          # all-gather, backward, free
    fsdp.sync_gradients()                      # reduce-scatter: this rank's mean gradient
    opt.step()                                 # update this rank's shard only
    opt.zero_grad()
print(f"rank {backend.rank} of {backend.world_size}: loss {losses[0]:.3f} at step 1, "
      f"{losses[-1]:.2g} at step {len(losses)}")
