"""The README's Python example runs as written: on a CPU-only machine with torch installed, in a
directory holding the `train.bin` it ingests (`make readme-example`; skipped without torch)."""

import os
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_the_readme_example_runs_as_written(tmp_path, monkeypatch, capsys):
    with open(README, encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert blocks, "README.md has a Python example"
    # 64 sequences of 2049 uint16 tokens, as train.bin of a GPT-style corpus would hold.
    rng = np.random.default_rng(0)
    rng.integers(0, 65536, (64, 2049), dtype=np.uint16).tofile(tmp_path / "train.bin")
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], "README.md", "exec"), {"__name__": "readme"})
    assert (tmp_path / "ckpt.pt").exists()
    printed = capsys.readouterr().out
    # Three epochs of two batches of 32, every block checked, none failed.
    assert "'batches': 6" in printed and "'verify_failures': 0" in printed, printed
