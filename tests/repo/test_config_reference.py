"""docs/configuration.md's key reference is generated from the dataclasses' field docs
(scripts/config_reference.py): every key documented, the page up to date."""

from __future__ import annotations

import subprocess
import sys

from tests.paths import ROOT


def test_every_key_has_a_field_doc_and_the_reference_is_up_to_date():
    done = subprocess.run(
        [sys.executable, "scripts/config_reference.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
