"""A rich progress bar for `LLM.generate`: prompts done and output tokens per second.

What it is not: required. `generate(..., progress=False)` turns it off (tests do), and it
draws nothing at all when disabled, so it costs nothing.
"""

from __future__ import annotations

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
