"""Renderers of analyzer results: HTML, JSON, Markdown, JUnit."""
