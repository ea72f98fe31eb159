"""ctest's entry to tests/security: runs pytest on the attacks whose names match `-k`, or exits
77 (ctest's visible skip) saying why they cannot run here (not root, no setpriv, ...).

    python3 run.py [PYTEST ARGS...]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import attacks  # noqa: E402

reason = attacks.skip_reason()
if reason:
    print(f"SKIPPED: tests/security {reason}")
    sys.exit(77)

import pytest  # noqa: E402

sys.exit(pytest.main([os.path.dirname(os.path.abspath(__file__)), "-q", "-rA",
                      "-p", "no:cacheprovider", *sys.argv[1:]]))
