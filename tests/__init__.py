"""The tests beyond the method's: test_all.py, at the top level, holds the method's and says what each
file here holds."""

import pytest

pytest.register_assert_rewrite('tests.common')  # the shared helpers' asserts say what failed, as a test's do
