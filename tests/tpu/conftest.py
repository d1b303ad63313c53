"""Skip every test of tests/tpu unless JAX's default backend is a TPU (or the CPU debugging switch is on).

The check runs at collection, not at import: importing this file initialises nothing. Only items under this
folder are marked (``pytest_collection_modifyitems`` sees the whole session's items).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .suite import ON_CPU_ENV, on_chip, suite_on_cpu

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if _HERE in Path(item.path).resolve().parents]
    if not mine or suite_on_cpu() or on_chip():
        return
    import jax

    skip = pytest.mark.skip(reason=f"TPU suite: JAX's default backend is {jax.default_backend()!r}, not 'tpu' "
                                   f"({ON_CPU_ENV}=1 runs it on the CPU to check the tests themselves)")
    for item in mine:
        item.add_marker(skip)
