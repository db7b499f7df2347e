"""Salt Inductor's and AOTAutograd's caches with a hash of our sources.

A custom op counts as cacheable by its name alone, so after an edit to a backward formula or a
kernel a stale compiled artefact could be served from the on-disk caches. A no-op
``CustomGraphPass`` whose ``uuid()`` hashes every source file of the package goes into the cache
key (``FxGraphHashDetails``, which the AOTAutograd cache key extends).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from torch._inductor.custom_graph_pass import CustomGraphPass

@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """sha256 of every ``.py`` file of twell_compile, lowering and kernels, in a stable order."""
    import importlib.util

    digest = hashlib.sha256()
    # The packages' folders, found without importing them (kernels/ is not twell_compile's to import).
    roots = [Path(importlib.util.find_spec(name).origin).parent
             for name in ("twell_compile", "twell_compile.lowering", "twell_compile.kernels")]
    for root in roots:
        for path in sorted(root.glob("*.py")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


class SourceSaltPass(CustomGraphPass):
    """Runs ``inner`` (a pass that was already configured, if any) and adds our hash to its uuid."""

    def __init__(self, inner=None):
        self.inner = inner

    def __call__(self, graph):
        if self.inner is not None:
            return self.inner(graph)
        return None

    def uuid(self):
        inner_uuid = self.inner.uuid() if hasattr(self.inner, "uuid") else repr(self.inner)
        return f"twell-{source_hash()}-{inner_uuid}"


def salted_config_patches() -> dict:
    """Inductor config patches that put the source hash into the compile cache keys."""
    from torch._inductor import config

    existing = config.post_grad_custom_post_pass
    if isinstance(existing, SourceSaltPass):
        return {}
    if isinstance(existing, (list, tuple)):  # torch >= 2.13 accepts lists of passes
        return {"post_grad_custom_post_pass": [*existing, SourceSaltPass()]}
    return {"post_grad_custom_post_pass": SourceSaltPass(existing)}
