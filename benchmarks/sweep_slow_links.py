"""Variants of local steps and of the int8 hook against DDP, by validation loss:
what was tried for DiLoCo's loss in docs/benchmarks/slow-links.md ("Over slow links").

Run book::

    python benchmarks/sweep_slow_links.py "ddp;diloco,h=32;diloco,h=32,q=0;diloco,h=32,olr=1.0,om=0.5"
    python benchmarks/sweep_slow_links.py "ddp,steps=1024;diloco,h=32,steps=1024;localsgd,h=32,steps=1024"
    python benchmarks/sweep_slow_links.py "ddp,batch=32,lr=1e-3;diloco,h=32,batch=32,lr=1e-3"

The model, text, batches and validation of benchmarks/bench_slow_links.py
(its seed 0 gives the same losses), on four ranks of this machine grouped as
two nodes of two, each variant after the other in one spawned group. A
variant is ``kind[,key=value...]``: kind ``ddp``, ``int8``, ``localsgd`` or
``diloco``; keys ``steps`` (256), ``batch`` (8), ``lr`` (3e-3), ``seed`` (0),
``block`` and ``bits`` (the int8 hook's), ``h`` (32), ``olr`` (0.7), ``om``
(0.9; Nesterov when above 0), ``q`` (8; 0 is fp32) and ``f`` (1; DiLoCo's
fragments). Prints each variant's validation loss and time.
"""

# ruff: noqa: E501, E702
import sys
import time

import torch

from tandem.testing import run_distributed


def work(rank, ws, variants):
    import os
    os.environ["GROUP_RANK"] = str(rank // 2)
    import tandem
    from tandem import comm_hooks
    from tandem.examples.gpt import Windows, lm_loss, load_text, split_text
    from tandem.examples.gpt_model import GPT, GPTConfig
    torch.set_num_threads(1)
    codec, train_ids, val_ids = split_text(load_text())
    out = {}
    for v in variants:
        kind, *kw = v.split(",")
        kw = dict(x.split("=") for x in kw)
        cfg = GPTConfig(vocab_size=codec.vocab_size, block_size=64, n_layer=2, n_head=4, n_embd=128, activation_checkpointing=False)
        model = GPT(cfg); model.init_weights(0)
        wrapped = model
        opt = torch.optim.AdamW(model.parameters(), lr=float(kw.get("lr", 3e-3)), betas=(0.9, 0.99), weight_decay=0.1)
        if kind in ("ddp", "int8"):
            wrapped = tandem.DistributedDataParallel(model)
        if kind == "int8":
            wrapped.register_comm_hook(comm_hooks.QuantizedState(int(kw.get("bits", 8)), block=int(kw.get("block", 256))), comm_hooks.quantized_hook)
        if kind == "localsgd":
            d = tandem.DiLoCo(model, opt, tandem.DiLoCoConfig.local_sgd(int(kw.get("h", 32))))
        if kind == "diloco":
            c = tandem.DiLoCoConfig(sync_every=int(kw.get("h", 32)), outer_lr=float(kw.get("olr", 0.7)), outer_momentum=float(kw.get("om", 0.9)),
                                    nesterov=float(kw.get("om", 0.9)) > 0, quantize=None if kw.get("q", "8") == "0" else int(kw.get("q", "8")),
                                    fragments=int(kw.get("f", 1)))
            d = tandem.DiLoCo(model, opt, c)
        train, val = Windows(train_ids, 64), Windows(val_ids, 64)
        gen = torch.Generator().manual_seed(rank + 100 * int(kw.get("seed", 0)))
        t0 = time.time()
        for _ in range(int(kw.get("steps", 256))):
            idx = torch.randint(0, len(train), (int(kw.get('batch', 8)),), generator=gen).tolist()
            x = torch.stack([train[i][0] for i in idx]); y = torch.stack([train[i][1] for i in idx])
            opt.zero_grad(set_to_none=True)
            lm_loss(wrapped(x), y).backward()
            opt.step()
        if kind in ("diloco", "localsgd"):
            d.flush(); d.remove()
        picks = torch.linspace(0, len(val) - 1, 256).long().tolist()
        with torch.no_grad():
            vx = torch.stack([val[i][0] for i in picks]); vy = torch.stack([val[i][1] for i in picks])
            loss = torch.tensor([float(lm_loss(model(vx), vy))])
        torch.distributed.all_reduce(loss)
        out[v] = (float(loss) / ws, time.time() - t0)
    return out

if __name__ == "__main__":
    r = run_distributed(work, 4, args=(sys.argv[1].split(";"),), timeout=1800)[0]
    for name, (loss, seconds) in r.items():
        print(f"{name:40s} loss {loss:.4f} time {seconds:.1f}s")
