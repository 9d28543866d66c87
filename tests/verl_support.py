"""verl's SandboxFusion reward code, loaded as verl ships it but without the rest of verl.

``verl/__init__.py`` imports Ray, torch and transformers (a GPU stack this machine does not
need and ``scripts/setup.sh`` does not install: it installs verl with ``--no-deps``). The
reward module ``verl/utils/reward_score/sandbox_fusion`` needs only ``requests``, so it is
loaded from verl's installed files as a package of its own: the code that runs is verl's,
byte for byte, and ``import verl`` never happens.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

MODULE = "verl_sandbox_fusion_reward"


def load_verl_sandbox_fusion() -> ModuleType:
    """verl's ``sandbox_fusion`` reward package (``compute_score``; ``.utils`` has
    ``check_correctness``)."""
    if MODULE in sys.modules:
        return sys.modules[MODULE]
    verl = importlib.util.find_spec("verl")  # finds it without importing it
    if verl is None or not verl.submodule_search_locations:
        raise RuntimeError("verl is not installed: run scripts/setup.sh")
    pkg = Path(next(iter(verl.submodule_search_locations))) / "utils/reward_score/sandbox_fusion"
    spec = importlib.util.spec_from_file_location(
        MODULE, pkg / "__init__.py", submodule_search_locations=[str(pkg)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[MODULE]
        raise
    return module
