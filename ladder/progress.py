"""Rich progress bars: `LLM.generate`'s (prompts done and output tokens per second), and
`StatusBar`, for a long start-up step (the compiled step's compile).

What it is not: required. `generate(..., progress=False)` turns it off (tests do), and it
draws nothing at all when disabled, so it costs nothing; a `StatusBar` draws only on a terminal.
"""

from __future__ import annotations

import sys
import time

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)


class GenerateProgress:
    def __init__(self, total: int, enabled: bool = True, description: str = "generating"):
        self.enabled, self.total = enabled, total
        self.tokens, self.start = 0, time.perf_counter()
        if enabled:
            self.bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("prompts  {task.fields[tps]:>8.1f} tok/s"),
                TimeElapsedColumn(),
                transient=False,
            )
            self.task = self.bar.add_task(description, total=total, tps=0.0)

    def __enter__(self):
        if self.enabled:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.__exit__(*exc)

    def update(self, finished: int = 0, new_tokens: int = 0) -> None:
        if not self.enabled:
            return
        self.tokens += new_tokens
        tps = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.update(self.task, advance=finished, tps=tps)


class StatusBar:
    """`with StatusBar("compiling", total=3) as bar: ... bar.advance()`: a bar that goes away when
    done (the log says what it took), drawn only where standard error is a terminal."""

    def __init__(self, description: str, total: int):
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), transient=True, disable=not sys.stderr.isatty())  # fmt: skip
        self.task = self.bar.add_task(description, total=total)

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        self.bar.__exit__(*exc)

    def advance(self) -> None:
        self.bar.update(self.task, advance=1)

    def report(self, line: str) -> None:
        """After the bar: one line saying what the step did, on the terminal the bar was drawn on (a
        log line at INFO says it too, for a process whose logging is configured)."""
        if not self.bar.disable:
            self.bar.console.print(line, highlight=False)
