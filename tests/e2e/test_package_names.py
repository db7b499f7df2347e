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
    the import on to the next ``kernels`` on the path."""
    script = ("import sys, importlib.util\n"
              "import kernels\n"
              "print(kernels.__file__)\n"
              "from transformers.integrations import hub_kernels\n")
    installed = importlib.util.find_spec("kernels") is not None
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    if installed:
        assert not _is_ours(proc.stdout.strip()), proc.stdout


# Hides every ``kernels`` but the repository's folder, as on a machine without Hugging Face's.
_WITHOUT_HF_KERNELS = """
import importlib.machinery, os, sys
ROOT = {root!r}
_find = importlib.machinery.PathFinder.find_spec.__func__
def find_spec(cls, name, path=None, target=None):
    spec = _find(cls, name, path, target)
    if name == "kernels" and spec is not None and not (spec.origin or "").startswith(ROOT + "/kernels/"):
        return None
    return spec
importlib.machinery.PathFinder.find_spec = classmethod(find_spec)
import importlib.metadata
_version = importlib.metadata.version
def version(name):
    if name == "kernels":
        raise importlib.metadata.PackageNotFoundError(name)
    return _version(name)
importlib.metadata.version = version
sys.path.insert(0, ROOT)  # what python -m / torchrun -m in the root does
"""


def test_without_hugging_face_kernels_a_run_from_the_root_still_imports_transformers():
    """``torchrun -m twell_compile.bench_distributed`` in the root, on a machine without Hugging
    Face's ``kernels``: transformers finds our folder under that name, imports it to read its
    version, and must be told "not installed" rather than fail."""
    script = _WITHOUT_HF_KERNELS.format(root=str(ROOT)) + (
        "import kernels\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from transformers.utils import is_kernels_available\n"
        "assert not is_kernels_available()\n"
        "cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,\n"
        "                  num_attention_heads=2, num_key_value_heads=2, hidden_act='relu')\n"
        "print(LlamaForCausalLM(cfg)(__import__('torch').randint(0, 64, (1, 5))).logits.shape)\n"
        "try:\n"
        "    kernels.get_kernel\n"
        "except AttributeError as e:\n"
        "    print('refused:', e)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd="/", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "torch.Size([1, 5, 64])" in proc.stdout
    assert "not installed" in proc.stdout and "twell_compile.kernels" in proc.stdout
