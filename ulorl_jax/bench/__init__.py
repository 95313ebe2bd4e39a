"""Benchmarks behind `ulorl bench ...`; each module has `add_arguments`, `run`, `format_table`, `main`."""
