"""Benchmarks: jobsignal against an idiomatic grpc.aio implementation of job.Job.

Run `nox -s bench` (or `python -m bench`); `--quick` for a tiny smoke run.
The report and plots go to bench/results/ (see bench/run.py).
"""
