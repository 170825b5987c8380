"""Trains a small bigram language model in JAX (on the CPU) on a token dataset read through
granary as a Grain iterator, stops halfway, saves the iterator's state with the parameters, and
resumes in a fresh iterator exactly where it stopped.

    pip install ./python grain "jax[cpu]"
    python examples/train_tokens_jax.py                   # makes its own data in a temp dir
    python examples/train_tokens_jax.py --steps 400 --batch 64

The tokens are synthetic but learnable (each token mostly follows from the one before), so the
loss falls well below log(vocab) if the batches are right. Prints one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from typing import Any, Dict

import jax
import jax.numpy as jnp
import numpy as np

import granary
import granary.grain


def make_tokens(n_windows: int, width: int, vocab: int, seed: int) -> np.ndarray:
    """Windows where the next token is (5 * prev + 3) % vocab nine times in ten, random otherwise."""
    rng = np.random.default_rng(seed)
    tokens = np.empty(n_windows * width, dtype=np.uint16)
    tokens[0] = 1
    noise = rng.random(len(tokens)) < 0.1
    random = rng.integers(0, vocab, len(tokens))
    for i in range(1, len(tokens)):
        tokens[i] = random[i] if noise[i] else (5 * int(tokens[i - 1]) + 3) % vocab
    return tokens.reshape(n_windows, width)


def loss_fn(params: jnp.ndarray, batch: jnp.ndarray) -> jnp.ndarray:
    """Next-token cross-entropy of a bigram model: logits of token t+1 are row tokens[t]."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = params[inputs]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


@jax.jit
def step(params: jnp.ndarray, batch: jnp.ndarray, lr: float):
    loss, grad = jax.value_and_grad(loss_fn)(params, batch)
    return params - lr * grad, loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--dir", default=None, help="where the store goes (default: a temp dir)")
    args = parser.parse_args()
    work = args.dir or tempfile.mkdtemp(prefix="granary-jax-")
    store = granary.Store(os.path.join(work, "store"), create=True)
    windows = make_tokens(4096, args.seq_len + 1, args.vocab, seed=0)
    if "tokens" not in [d["name"] for d in store.datasets()]:
        store.ingest("tokens", list(windows), dtype=np.uint16, shape=[args.seq_len + 1])

    # granary plans, prefetches and verifies; Grain's map turns each batch into int32 for JAX.
    def dataset():
        return granary.grain.LoaderDataset(store, "tokens", args.batch, seed=0, num_epochs=None, output="numpy").map(
            lambda b: b.astype(np.int32)
        )

    params = jnp.zeros((args.vocab, args.vocab))
    it = iter(dataset())
    losses = []
    half = args.steps // 2
    for _ in range(half):
        params, loss = step(params, jnp.asarray(next(it)), 5.0)
        losses.append(float(loss))
    # A checkpoint: the parameters and the iterator's state (plain values, JSON-safe).
    checkpoint: Dict[str, Any] = {"state": json.dumps(it.get_state()), "params": np.asarray(params)}
    expected_next = np.asarray(next(it))

    # A "restarted process": a fresh iterator set to the saved state gives the same next batch.
    it = iter(dataset())
    it.set_state(json.loads(checkpoint["state"]))
    params = jnp.asarray(checkpoint["params"])
    resumed_next = np.asarray(next(it))
    assert np.array_equal(resumed_next, expected_next), "the resumed iterator gives another batch"
    params, loss = step(params, jnp.asarray(resumed_next), 5.0)
    losses.append(float(loss))
    for _ in range(args.steps - half - 1):
        params, loss = step(params, jnp.asarray(next(it)), 5.0)
        losses.append(float(loss))
    result = {
        "steps": args.steps,
        "first_loss": round(losses[0], 3),
        "last_loss": round(float(np.mean(losses[-10:])), 3),
        "log_vocab": round(math.log(args.vocab), 3),
        "resumed_exactly": True,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
