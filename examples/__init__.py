"""Examples of jax_kvcm (``examples.llama``: the Llama runner and its HTTP server).

``python -m examples.llama.run`` (or ``.server``) from the repository root puts the root first on
``sys.path``, where the unbuilt ``jax_kvcm/`` source tree (no native extension) would shadow the
installed package: the installed one is imported first here.
"""

import importlib
import os
import sys


def _import_installed_jax_kvcm() -> None:
    if "jax_kvcm" in sys.modules:
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if os.path.abspath(p or os.curdir) != root]
    try:
        importlib.import_module("jax_kvcm")
    except ImportError:  # not installed elsewhere (e.g. built in place): the tree's own copy
        sys.modules.pop("jax_kvcm", None)
    finally:
        sys.path[:] = saved


_import_installed_jax_kvcm()
