"""`python -m anyrec_simdev.selfcheck`: the device works, and refuses a host tensor where it belongs.

Trains a small model one step on simdev and on the CPU from the same seed (the numbers must be
equal), checks a view shares device memory, then passes host ids to an embedding lookup on the
device: that must fail with the strictness check's message naming the op. Exit status 0 when all hold.
"""

from __future__ import annotations

import sys

import torch

from anyrec_simdev import module
from anyrec_simdev.device import NAME, MisplacedTensorError


def _step(device: str) -> tuple[float, torch.Tensor]:
    torch.manual_seed(0)
    emb = torch.nn.EmbeddingBag(20, 4, mode="sum").to(device)
    lin = torch.nn.Linear(4, 1).to(device)
    opt = torch.optim.Adagrad([*emb.parameters(), *lin.parameters()], lr=0.1)
    ids = torch.tensor([1, 5, 7, 1, 19]).to(device)
    offsets = torch.tensor([0, 2]).to(device)
    loss = lin(emb(ids, offsets)).pow(2).sum()
    loss.backward()
    opt.step()
    return loss.item(), emb.weight.detach().cpu()


def main() -> int:
    loss_dev, w_dev = _step(NAME)
    loss_cpu, w_cpu = _step("cpu")
    print(f"one training step: loss {loss_dev:.6f} on {NAME}, {loss_cpu:.6f} on cpu; "
          f"weights equal: {torch.equal(w_dev, w_cpu)}")
    x = torch.arange(6.0, device=NAME)
    view = x.view(2, 3)[1]
    view.add_(10)
    shared = view.data_ptr() == x.data_ptr() + 3 * x.element_size() and x.cpu().tolist()[3] == 13.0
    print(f"views share device memory: {shared}; allocated {module.memory_allocated()} bytes, "
          f"peak {module.max_memory_allocated()}")
    emb = torch.nn.EmbeddingBag(20, 4).to(NAME)
    try:
        emb(torch.tensor([1, 2, 3]), torch.tensor([0]))  # host ids: the mistake the check is for
        print("strictness check: DID NOT FIRE")
        fired = False
    except MisplacedTensorError as e:
        print(f"strictness check: {e}")
        fired = True
    ok = loss_dev == loss_cpu and torch.equal(w_dev, w_cpu) and shared and fired
    print("selfcheck: ok" if ok else "selfcheck: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
