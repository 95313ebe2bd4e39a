"""The checkout's layout never shadows an installed package.

`python -m pytest`, a script run from the checkout's root or a notebook opened
there put the root first on `sys.path`; a top-level folder that is a regular
package (has an `__init__.py`) then wins over any installed package of the same
name. transformers >= 5.25 imports the PyPI package `kernels` when it loads a
model, and our top-level `kernels/` used to be such a folder. The project's
kernels are importable as `ulorl_jax.kernels` only.
"""

import importlib.metadata
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

_FROM_ROOT = textwrap.dedent(
    """
    import os, sys, tempfile
    root = sys.argv[1]
    sys.path.insert(0, root)  # what `python -m pytest` / a script in the root does
    import torch, transformers
    import kernels
    assert not os.path.abspath(kernels.__file__ or "").startswith(os.path.join(root, "kernels")), (
        "import kernels found the checkout's folder: " + str(kernels.__file__))
    cfg = transformers.Qwen3Config(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    with tempfile.TemporaryDirectory() as folder:
        transformers.Qwen3ForCausalLM(cfg).save_pretrained(folder)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert tuple(logits.shape) == (1, 3, 61), logits.shape
    import ulorl_jax.kernels as k
    assert callable(k.attention) and callable(k.decode) and callable(k.gmm)
    print("ok", kernels.__file__, k.__file__)
    """
)


def test_transformers_loads_a_model_from_the_checkout_root():
    """A process whose sys.path starts with the checkout's root loads a tiny Qwen3 through
    AutoModelForCausalLM (transformers imports the PyPI `kernels` there) and imports ulorl_jax.kernels."""
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _FROM_ROOT, str(ROOT)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok"), proc.stdout


def test_no_top_level_folder_shadows_an_installed_package():
    """Every top-level folder that is a regular package is named unlike any installed distribution's
    top-level module (the rule in DESIGN.md); `kernels/` is a plain folder holding the package."""
    installed = importlib.metadata.packages_distributions()
    regular = sorted(p.name for p in ROOT.iterdir()
                     if p.is_dir() and (p / "__init__.py").exists() and p.name != "ulorl_jax")
    clashes = {name: installed[name] for name in regular if name in installed}
    assert not clashes, f"top-level folders shadow installed packages: {clashes}"
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert (ROOT / "kernels" / "pallas" / "__init__.py").exists()


def test_kernels_package_maps_to_the_folder():
    """ulorl_jax.kernels is the code under kernels/pallas/ (editable install) or its installed copy."""
    import ulorl_jax.kernels as k

    path = pathlib.Path(k.__file__).resolve()
    assert path.name == "__init__.py"
    assert path.parent == ROOT / "kernels" / "pallas" or path.parent.parts[-2:] == ("ulorl_jax", "kernels")


def test_every_subpackage_is_listed_for_setuptools():
    """pyproject.toml lists the packages by hand: a folder under ulorl_jax/ with an `__init__.py` that is
    missing there works in an editable install (this checkout) and is absent from a built wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "ulorl_jax").rglob("__init__.py")}
    assert on_disk - listed == set(), f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"
    assert {"ulorl_jax.kernels", "ulorl_jax.configs"} <= listed
