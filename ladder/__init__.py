"""Shared helpers that sit below every level: not an engine, and no level's idea lives here.

What it is: the built-in models' names and where they are (`models.py`), the progress
bar `LLM.generate` draws (`progress.py`), the metric records every engine reports
(`metrics.py`: vLLM's Counter, Gauge, Histogram), the registry of rooms (`rooms.py`: which
capability in `features/` answers a setting), and the pieces every command-line tool shares:
flag types that refuse nonsense, the device check, thread count, where pictures go,
the demos' prompts (`cli.py`); `python -m ladder` (`main.py`) is the `ladder` command.

What it is not: part of the ladder. Levels, rooms, benchmarks and tests import it; it imports
no level, and names the rooms only as strings (rooms.py).
"""
