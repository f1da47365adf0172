"""Analysis of run tables: pure pandas/numpy functions, never torch."""
