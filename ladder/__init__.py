"""Shared helpers that sit below every level: not an engine, and no level's idea lives here.

What it is: the built-in models' names and where they are (`models.py`), the progress
bar `LLM.generate` draws (`progress.py`), and the pieces every command-line tool shares:
flag types that refuse nonsense, the device check, thread count, where pictures go,
the demos' prompts (`cli.py`).

What it is not: part of the ladder. Levels, benchmarks and tests import it; it imports
no level.
"""
