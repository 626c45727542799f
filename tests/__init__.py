"""The tests beyond those to read first: test_all.py, at the top level, holds the method's read-first
tests and says what each file here holds; conftest.py the fixtures shared here, common.py the helpers."""

import pytest

pytest.register_assert_rewrite('tests.common')  # the shared helpers' asserts say what failed, as a test's do
