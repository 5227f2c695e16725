"""The package's top level: `load_model` and `Model` are there, and importing stays light."""

import subprocess
import sys

import pytest

import cfr_atlas

PROBE = """
import sys
import cfr_atlas
heavy = [m for m in ("cfr_atlas.engine", "cfr_atlas.models", "tokenizers", "starlette", "jinja2")
         if m in sys.modules]
assert not heavy, heavy
from cfr_atlas import load_model, Model
assert "cfr_atlas.engine" in sys.modules and load_model.__module__ == "cfr_atlas.engine"
"""


def test_import_is_light_and_load_model_resolves_lazily():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_exports_are_listed_and_unknown_names_raise():
    assert {"load_model", "Model"} <= set(cfr_atlas.__all__) <= set(dir(cfr_atlas))
    with pytest.raises(AttributeError, match="no_such_thing"):
        cfr_atlas.no_such_thing  # noqa: B018
