"""A single-GPU model: it inherits the trait's defaults and overrides nothing.

python examples/single_gpu.py
"""

import torch

from metrale_model_engine import ModelEp


class TinyLm(torch.nn.Module, ModelEp):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)


model = TinyLm()
assert not model.is_ep()  # the scheduler keeps its fused paths
model.ep_broadcast_cmd(3)  # checked, nothing sent
assert model.ep_broadcast_tokens([1, 2]) == []
print("single-GPU defaults hold")
