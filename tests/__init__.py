"""jobsignal's test suite; the helpers its tests share are in tests/support/."""
