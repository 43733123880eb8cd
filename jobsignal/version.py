"""The version of jobsignal: one place, read by the package, its build and its User-Agent."""

__version__ = "0.1.0"
