"""TwELL kernels: the format, its pure-PyTorch reference, and the Triton kernels.

This layer knows nothing about torch.compile. Triton modules are imported lazily by the ops that
launch them, so importing this package never needs a GPU.
"""

if __name__ == "kernels":
    # This folder is only ever ``twell_compile.kernels``. Reached as a top-level ``kernels`` (a
    # script run from the repository root puts the root first on ``sys.path``), it would shadow
    # Hugging Face's ``kernels`` package, which transformers imports: hand that import to the
    # next ``kernels`` on the path instead, or fail saying why.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _rest = [p for p in _sys.path if _os.path.abspath(p or _os.getcwd()) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _rest)
    if _spec is None:
        raise ImportError(
            f"no module named 'kernels' outside {_root}: that folder is twell-compile's, imported as "
            "twell_compile.kernels (install the project with pip install -e .)")
    _module = _util.module_from_spec(_spec)
    _sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds now
    _spec.loader.exec_module(_module)
else:
    from .format import DEFAULT_LAYOUT, SLOTS_PER_TILE, TILE_N, TwellLayout, TwellPacked

    __all__ = ["DEFAULT_LAYOUT", "SLOTS_PER_TILE", "TILE_N", "TwellLayout", "TwellPacked"]
