"""Airflow adapters; see the package docstring."""
