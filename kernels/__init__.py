"""TwELL kernels: the format, its pure-PyTorch reference, and the Triton kernels.

This layer knows nothing about torch.compile. Importing the package defines the Triton kernels but
compiles none, so it needs no GPU; ``TRITON_INTERPRET=1`` must be set before it is imported for the
kernels to run in Triton's interpreter (``triton_helpers.INTERPRET``).

The names below are the layer's interface. A module and a function can share a name
(``gate_pack``, ``sparse_ffn``): the package attribute is the function; a module's other names are
imported from the module itself (``from twell_compile.kernels.gate_pack import ...``).
"""

if __name__ == "kernels":
    # This folder is only ever ``twell_compile.kernels``. Reached as a top-level ``kernels`` (a
    # script run from the repository root puts the root first on ``sys.path``), it would shadow
    # Hugging Face's ``kernels`` package, which transformers imports: hand that import to the
    # next ``kernels`` on the path instead. Where there is none, stay an empty module that
    # transformers' availability check reads as "not installed" (no ``__file__``, no version), so
    # that ``torchrun -m`` or ``python script.py`` in the root still imports transformers.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _rest = [p for p in _sys.path if _os.path.abspath(p or _os.getcwd()) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _rest)
    if _spec is None:
        __file__ = None
        __path__ = []

        def __getattr__(name):
            raise AttributeError(
                f"module 'kernels' has no attribute {name!r}: Hugging Face's kernels package is not installed, "
                f"and {_root}/kernels is twell-compile's folder, imported as twell_compile.kernels")
    else:
        _module = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds now
        _spec.loader.exec_module(_module)
else:
    from . import reference
    from .dense_act import dense_activation, dense_activation_backward
    from .dense_rows import DENSE_ROW_FRACTION_MAX
    from .fired_neurons import stamp_fired, warm_stamp_fired
    from .floors import active_pairs, gather_floor
    from .format import (DEFAULT_LAYOUT, SLOTS_PER_TILE, TILE_N, TwellLayout, TwellPacked, accumulation_dtype,
                         empty_packed, is_paired)
    from .gate_pack import gate_pack
    from .launch import first_launches, tuned_configs
    from .row_lists import RowList, dense_list, flag_rows
    from .sparse_ffn import sparse_ffn
    from .sparse_ffn_bwd import DENSE_WGRAD_GEMM_ROWS, sparse_ffn_backward
    from .tickets import CallRecord
    from .weights import guard_bounds, transposed, weight_prep

    __all__ = [
        # the TwELL format
        "DEFAULT_LAYOUT", "SLOTS_PER_TILE", "TILE_N", "TwellLayout", "TwellPacked", "accumulation_dtype",
        "empty_packed", "is_paired",
        # the pure-PyTorch reference (a module)
        "reference",
        # the sparse path: pack, forward, backward
        "gate_pack", "sparse_ffn", "sparse_ffn_backward", "DENSE_WGRAD_GEMM_ROWS",
        # the dense path's element-wise passes
        "dense_activation", "dense_activation_backward",
        # per-weight work
        "weight_prep", "guard_bounds", "transposed",
        # dense rows: flags, lists, the call record
        "flag_rows", "dense_list", "RowList", "CallRecord", "DENSE_ROW_FRACTION_MAX",
        # telemetry: the neurons a sampled call fired
        "stamp_fired", "warm_stamp_fired",
        # the bench's floors and the autotuner's choices
        "tuned_configs", "first_launches", "gather_floor", "active_pairs",
    ]
