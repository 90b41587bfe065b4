"""What tests import and are not tests (tests/support/layout.py says where a test file belongs)."""
