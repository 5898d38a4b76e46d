"""Shared helpers: build a model in each of the three program forms.

Hypothesis profiles: ``default`` (CI and every plain run) and ``soak`` (15x the examples, no
deadline), chosen with ``pytest --hypothesis-profile=soak`` or ``HYPOTHESIS_PROFILE=soak``.
A test's own ``@settings(max_examples=...)`` wins over the profile (the property tests keep their
counts); ``tests/core/test_fuzz.py`` sizes itself from the profile: 1,000 graphs, or 15,000 on soak.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

from hypothesis import settings

warnings.filterwarnings("ignore")

# hypothesis's own default count; a deadline only catches an example that hangs (these run in ms),
# not a slow shared machine; a failure prints the blob that replays it (@reproduce_failure)
settings.register_profile("default", max_examples=100, deadline=timedelta(seconds=5), print_blob=True)
settings.register_profile("soak", max_examples=1500, deadline=None, print_blob=True)
# loaded here, before the test modules are imported (settings resolve when a test is decorated);
# the --hypothesis-profile flag, handled by hypothesis's pytest plugin afterwards, overrides it
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
