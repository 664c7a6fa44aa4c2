"""Shared helpers for the sparkfleet test suite (importable as ``support``)."""
