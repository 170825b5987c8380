"""The package is typed (PEP 561's `py.typed`): mypy reads its hints, and the examples and the
README's Python blocks check against the installed package as a user's IDE would read them.
Each venv checks what it can import: the torch venv the torch example and the blocks that use
torch, the other venv the rest (the JAX example, Grain's blocks)."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("mypy")

import granary

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
# A block after the first uses the store the first one made.
PREAMBLE = "import granary\nstore = granary.Store('store')\n"


def test_the_installed_package_says_it_is_typed():
    assert os.path.exists(os.path.join(os.path.dirname(granary.__file__), "py.typed"))


def test_the_examples_and_the_readme_blocks_check_against_the_installed_package(tmp_path):
    with_torch = importlib.util.find_spec("torch") is not None
    examples = [os.path.join(ROOT, "examples", "train_tokens.py" if with_torch else "train_tokens_jax.py")]
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) >= 3, "README.md has its Python blocks"
    for i, block in enumerate(blocks):
        if ("torch" in block) != with_torch:
            continue
        path = tmp_path / f"readme_block_{i}.py"
        path.write_text(block if "granary.Store(" in block else PREAMBLE + block)
        examples.append(str(path))
    assert len(examples) >= 2, examples
    # Other packages' missing hints are theirs (Grain ships none); granary's must all be there.
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\n[mypy-grain.*]\nignore_missing_imports = True\n[mypy-grain]\nignore_missing_imports = True\n")
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "--no-incremental", "--cache-dir",
         str(tmp_path / "cache"), *examples],
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
