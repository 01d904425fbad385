"""A benchmark's function called in another Python: its JSON result, or its error."""

from __future__ import annotations

import sys

import pytest

from benchmarks._remote import call_in_python


def test_the_result_comes_back_as_json():
    assert call_in_python(sys.executable, "json", "loads", '{"a": [1, 2]}') == {"a": [1, 2]}


def test_a_failure_names_the_function_and_ends_with_its_error():
    with pytest.raises(RuntimeError, match=r"(?s)json.loads failed in .* \(exit 1\): Traceback.*JSONDecodeError"):
        call_in_python(sys.executable, "json", "loads", "{")
