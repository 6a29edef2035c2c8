"""QLoRA under ``tandem.fully_shard``: frozen NF4 base weights (torchao's
``to_nf4``, whose ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` keep them
quantized while sharded and gathered: Note [tensor-subclass gathers] in
tandem/fsdp/unit_params.py) with trainable LoRA adapters, as torchtune's
``LoRALinear`` builds them, on 2 gloo ranks against torch's own
``fully_shard`` running the same script.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from test_fsdp import fully_shard_of
from torch import nn

from tandem.testing import as_dtensor, prefixed, run_distributed

nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor",
                          reason="torchao (NF4Tensor) is not installed: pip install torchao")

WORLD, DIM, RANK, STEPS = 2, 256, 8, 20


class QLoRALinear(nn.Module):
    """torchtune's QLoRA linear: ``x W^T + (alpha / r) x A^T B^T``, W frozen in NF4."""

    def __init__(self, dim: int, rank: int, alpha: float = 16.0) -> None:
        super().__init__()
        base = nn.Linear(dim, dim, bias=False, dtype=torch.bfloat16)
        self.weight = nn.Parameter(nf4.to_nf4(base.weight.detach()), requires_grad=False)
        self.lora_a = nn.Linear(dim, rank, bias=False, dtype=torch.bfloat16)
        self.lora_b = nn.Linear(rank, dim, bias=False, dtype=torch.bfloat16)
        nn.init.normal_(self.lora_b.weight, std=0.02)  # torchtune zeros it; nonzero makes step 1 informative
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nf4.linear_nf4(x, self.weight) + self.scale * self.lora_b(self.lora_a(x))


def _train(rank: int, impl: str) -> dict:
    from tandem.comm.monitor import current_monitor

    torch.manual_seed(0)
    layers = [QLoRALinear(DIM, RANK) for _ in range(3)]
    model = nn.Sequential(*layers)
    shard = fully_shard_of(impl, min_unit_bytes=0)
    for layer in layers:
        shard(layer)
    shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    gen = torch.Generator().manual_seed(1 + rank)
    ledger = current_monitor().ledger
    losses, first = [], 0
    for _ in range(STEPS):
        first = ledger.issued
        x = torch.randn(4, DIM, generator=gen).to(torch.bfloat16)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    weights: list[Any] = [as_dtensor(layer.weight).to_local() for layer in layers]  # torchao's NF4Tensors
    payload = sum(t.numel() * t.element_size() for w in weights
                  for t in (w.quantized_scalers, w.quantization_factor, w.quantized_data))
    sent = [(e.tag, e.nbytes) for e in ledger.entries() if e.seq > first and e.op == "all_gather_into"]
    return {"losses": torch.stack(losses), "payload": payload, "gathers": sent,
            "bf16_bytes": sum(w.numel() * 2 for w in weights), "types": [type(w).__name__ for w in weights],
            "adapters": {n: as_dtensor(p).to_local().float().clone()
                         for n, p in model.named_parameters() if p.requires_grad}}


def _worker(rank: int, world_size: int) -> dict:
    return {impl: _train(rank, impl) for impl in ("tandem", "torch")}


@functools.cache
def _results() -> list[dict]:
    return run_distributed(_worker, WORLD, timeout=300)


def test_qlora_trains_as_under_torchs_fsdp2() -> None:
    for rank, result in enumerate(_results()):
        ours, torchs = result["tandem"], result["torch"]
        assert ours["types"] == torchs["types"] == ["NF4Tensor"] * 3  # the shards stay quantized
        torch.testing.assert_close(ours["losses"], torchs["losses"], atol=1e-4, rtol=1e-3,
                                   msg=prefixed(f"rank {rank}"))
        for name, value in ours["adapters"].items():
            torch.testing.assert_close(value, torchs["adapters"][name], atol=1e-3, rtol=1e-2,
                                       msg=prefixed(f"rank {rank}, {name}"))
        assert ours["losses"][-1] < ours["losses"][0]


def test_the_nf4_weights_travel_quantized() -> None:
    """A step gathers each layer's NF4 shard (4-bit data and its scalers) in
    forward and again in backward: a little over a quarter of its bfloat16 bytes."""
    for result in _results():
        ours = result["tandem"]
        subclass = sum(n for tag, n in ours["gathers"] if tag.endswith(" subclasses"))
        assert subclass == 2 * ours["payload"], ours["gathers"]
        assert subclass < 2 * ours["bf16_bytes"] * 0.27, (subclass, ours["bf16_bytes"])
