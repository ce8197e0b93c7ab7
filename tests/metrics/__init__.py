"""Tests for :mod:`anyio_genout.metrics`."""
