"""Hypothesis settings for the property tests of the decoders that read outside bytes.

Every property runs twice: `quick(...)` in every test run (QUICK examples, seconds), and
`long(...)`, marked `fuzz`, which only runs when asked for with `python -m pytest -m fuzz`
(FUZZ examples each, a few minutes in all; skipped otherwise, so a default run stays short).
Neither keeps an example database: a run leaves no files behind.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

QUICK = int(os.environ.get("TESTBED_QUICK_EXAMPLES", "60"))
FUZZ = int(os.environ.get("TESTBED_FUZZ_EXAMPLES", "3000"))
COMMON = dict(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)


def quick(test, examples: int = QUICK):
    """The property with QUICK examples (fewer for a slow one): part of every test run."""
    return settings(max_examples=examples, **COMMON)(test)


def long(test, examples: int = FUZZ):
    """The property with FUZZ examples (fewer for a slow one), marked `fuzz`: runs under `-m fuzz`,
    skipped otherwise."""
    return pytest.mark.fuzz(pytest.mark.usefixtures("fuzz_selected")(settings(max_examples=examples, **COMMON)(test)))


@pytest.fixture
def fuzz_selected(request):
    """Skips a long fuzz test unless the run selected the `fuzz` marker."""
    if "fuzz" not in (request.config.option.markexpr or "") or "not fuzz" in request.config.option.markexpr:
        pytest.skip("the long fuzz run: python -m pytest -m fuzz")
