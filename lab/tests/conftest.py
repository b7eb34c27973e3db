"""The lab's tests use the plug-in's test helpers: the tiny models
(``tests/tiny_models``) and the fixtures of ``tests/conftest.py``, loaded here under
another module name."""

import importlib.util
import sys
from pathlib import Path

PLUGIN_TESTS = Path(__file__).resolve().parents[2] / "tests"
sys.path.insert(0, str(PLUGIN_TESTS))

_spec = importlib.util.spec_from_file_location(
    "plugin_conftest", PLUGIN_TESTS / "conftest.py"
)
_plugin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_plugin)
logged_warnings = _plugin.logged_warnings
single_thread = _plugin.single_thread
