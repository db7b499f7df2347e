"""The repository's ``kernels/`` folder never stands in for Hugging Face's ``kernels`` package.

transformers imports ``kernels`` (``transformers.integrations.hub_kernels``). Our folder of that
name is installed as ``twell_compile.kernels``; a test run, or a script started from the
repository root, must not find it under the top-level name.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _is_ours(origin: str | None) -> bool:
    return origin is not None and Path(origin).resolve().is_relative_to(ROOT / "kernels")


def test_the_top_level_name_kernels_is_not_our_folder():
    spec = importlib.util.find_spec("kernels")
    assert spec is None or not _is_ours(spec.origin), spec


def test_our_kernels_are_reached_as_twell_compile_kernels():
    import twell_compile.kernels as ours

    assert _is_ours(ours.__file__)
    assert ours.TILE_N > 0


def test_a_transformers_model_through_hub_kernels_builds_and_runs():
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations import hub_kernels  # noqa: F401  (the import that failed)

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, hidden_act="relu")
    logits = LlamaForCausalLM(config)(torch.randint(0, 64, (1, 5))).logits
    assert logits.shape == (1, 5, 64) and torch.isfinite(logits).all()


def test_a_script_run_from_the_repository_root_gets_the_installed_kernels():
    """``python script.py`` in the root puts the root first on ``sys.path``; our folder then hands
    the import on to the next ``kernels`` on the path, or fails saying so."""
    script = ("import sys, importlib.util\n"
              "import kernels\n"
              "print(kernels.__file__)\n"
              "from transformers.integrations import hub_kernels\n")
    installed = importlib.util.find_spec("kernels") is not None
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if installed:
        assert proc.returncode == 0, proc.stderr
        assert not _is_ours(proc.stdout.strip()), proc.stdout
    else:
        assert proc.returncode != 0 and "twell_compile.kernels" in proc.stderr, proc.stderr
