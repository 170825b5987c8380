"""Trains a small language model on a token dataset read through granary, then the same with a
plain `torch.utils.data.DataLoader` over the same file, and prints samples/s and data stall
(the share of the run the training loop spent waiting for its next batch) for both.

    pip install ./python torch
    python examples/train_tokens.py                       # makes its own data in a temp dir
    python examples/train_tokens.py --steps 2000 --batch 64 --loader granary

The dataset is synthetic but learnable (each token mostly follows from the one before), so the
loss falls well below log(vocab) if the batches are right. Runs on the GPU when there is one.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

import granary


def make_tokens(path: str, n_tokens: int, vocab: int, seed: int) -> None:
    """Tokens where the next one is (5 * prev + 3) % vocab nine times in ten, random otherwise."""
    rng = np.random.default_rng(seed)
    tokens = np.empty(n_tokens, dtype=np.int32)
    tokens[0] = 0
    noise = rng.random(n_tokens) < 0.1
    randoms = rng.integers(0, vocab, n_tokens)
    for i in range(1, n_tokens):
        tokens[i] = randoms[i] if noise[i] else (5 * tokens[i - 1] + 3) % vocab
    tokens.tofile(path)


class TinyLM(nn.Module):
    mask: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, vocab: int, seq: int, width: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(seq, width))
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        return self.head(self.body(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True))


class TokenFile(torch.utils.data.Dataset):
    """The plain-PyTorch way: records of `seq + 1` int32 tokens from a memory-mapped file."""

    def __init__(self, path: str, record: int) -> None:
        self.path, self.record = path, record
        self.n = os.path.getsize(path) // (4 * record)
        self.tokens: Optional[np.memmap] = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.tokens is None:  # opened in the worker
            self.tokens = np.memmap(self.path, dtype=np.int32, mode="r")
        return torch.from_numpy(np.array(self.tokens[i * self.record : (i + 1) * self.record]))


def train(name: str, batches, steps: int, vocab: int, seq: int, device: torch.device) -> None:
    torch.manual_seed(0)
    model = TinyLM(vocab, seq).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    waited = 0.0
    losses = []
    it = iter(batches)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for step in range(steps):
        t = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:  # an epoch ended: the next one
            it = iter(batches)
            batch = next(it)
        batch = batch.to(device, non_blocking=True).long()
        waited += time.perf_counter() - t
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            losses.append(loss.item())
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    n = steps * batch.shape[0]
    print(
        f"{name:>10}: {n / elapsed:10.0f} samples/s, data stall {100 * waited / elapsed:5.1f}% "
        f"({waited:.2f} s of {elapsed:.2f} s), loss {losses[0]:.2f} -> {losses[-1]:.2f} "
        f"(uniform would be {math.log(vocab):.2f})"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="where to keep the store and the token file (default: a temp dir)")
    p.add_argument("--tokens", type=int, default=4_000_000)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--workers", type=int, default=min(8, (os.cpu_count() or 2) - 1))
    p.add_argument("--loader", choices=["granary", "dataloader", "both"], default="both")
    p.add_argument(
        "--order",
        choices=["record", "block"],
        default="record",
        help="granary's shuffle: record-level, or blocks of 64 consecutive records (read in runs, not one record at a time)",
    )
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = a.dir or tempfile.mkdtemp(prefix="granary-train-")
    record = a.seq + 1
    path = os.path.join(work, "tokens.bin")
    if not os.path.exists(path):
        make_tokens(path, a.tokens - a.tokens % record, a.vocab, seed=1)
    store = granary.Store(os.path.join(work, "store"), create=True)
    if not any(d["name"] == "tokens" for d in store.datasets()):
        store.ingest_files("tokens", path, dtype="int32", shape=[record], progress=True)
    print(f"device {device}, {os.path.getsize(path) // (4 * record)} records of {record} tokens, batch {a.batch}")

    if a.loader in ("granary", "both"):
        block = {"partitioner_options": {"chunk-records": 64}} if a.order == "block" else {}
        loader = store.loader("tokens", batch_size=a.batch, seed=0, device=str(device), **block)
        train(f"granary ({a.order})", loader, a.steps, a.vocab, a.seq, device)
        m = loader.metrics()
        print(
            f"{'':>10}  loader: {m['batches']} batches, stall {m['stall_seconds']:.2f} s, "
            f"prefetched when asked {100 * m['cache_hit_ratio']:.0f}%, verify failures {m['verify_failures']}"
        )
    if a.loader in ("dataloader", "both"):
        dl = torch.utils.data.DataLoader(
            TokenFile(path, record),
            batch_size=a.batch,
            shuffle=True,
            num_workers=a.workers,
            pin_memory=device.type == "cuda",
            drop_last=True,
            persistent_workers=a.workers > 0,
        )
        train("DataLoader", dl, a.steps, a.vocab, a.seq, device)


if __name__ == "__main__":
    main()
