"""What a person sees while ``atlas run`` works: one line per stage, a progress bar with row
counts for long stages, and a summary table at the end. Ray's own INFO lines and Ray Data's
progress output go to the log file (or nowhere), never to the terminal.

Library code reaches the console only through :meth:`atlas.stage.StageContext.progress`;
with no console installed (a notebook calling a stage function) progress is a no-op.
"""

from __future__ import annotations

import logging
import time
from typing import Any

_current: "RunConsole | None" = None
RAY_LOGGERS = ("ray", "ray.data", "ray.train", "ray.tune", "ray.serve")


class NullProgress:
    """Progress handle that shows nothing (no console installed)."""

    def advance(self, n: int = 1) -> None: ...

    def update(self, *, total: int | None = None, completed: int | None = None) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> "NullProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _RichProgress(NullProgress):
    def __init__(self, progress: Any, desc: str, total: int | None):
        self._p = progress
        self._task = progress.add_task(desc, total=total)

    def advance(self, n: int = 1) -> None:
        self._p.advance(self._task, n)

    def update(self, *, total: int | None = None, completed: int | None = None) -> None:
        kw: dict[str, Any] = {}
        if total is not None:
            kw["total"] = total
        if completed is not None:
            kw["completed"] = completed
        self._p.update(self._task, **kw)

    def close(self) -> None:
        t = self._p.tasks[[x.id for x in self._p.tasks].index(self._task)]
        if t.total is None:
            self._p.update(self._task, total=t.completed)
        self._p.stop_task(self._task)


class RunConsole:
    """A rich console for one run (stderr, so stdout stays clean for piping)."""

    def __init__(self, quiet: bool = False, log_file: str | None = None):
        from rich.console import Console

        self.console = Console(stderr=True, quiet=quiet)
        self.log_file = log_file
        self._progress = None

    def install(self) -> "RunConsole":
        global _current
        _current = self
        return self

    def uninstall(self) -> None:
        global _current
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if _current is self:
            _current = None

    def stage_started(self, name: str) -> None:
        self.console.print(f"[bold]▶ {name}[/bold]")

    def stage_ended(self, name: str, status: str, seconds: float | None, note: str = "") -> None:
        mark = {"done": "[green]✔[/green]", "skipped": "[yellow]↷[/yellow]", "failed": "[red]✘[/red]"}.get(status, "·")
        secs = f" in {seconds:.1f}s" if seconds is not None else ""
        self.console.print(f"{mark} {name}: {status}{secs}{(' — ' + note) if note else ''}")

    def progress(self, desc: str, total: int | None = None) -> NullProgress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        if self._progress is None:
            self._progress = Progress(
                TextColumn("  {task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("rows"),
                TimeElapsedColumn(),
                console=self.console,
                transient=False,
            )
            self._progress.start()
        return _RichProgress(self._progress, desc, total)

    def end_progress(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def summary(self, manifest: dict) -> None:
        self.end_progress()
        print_summary(manifest, self.console)


def progress(desc: str, total: int | None = None) -> NullProgress:
    return _current.progress(desc, total) if _current is not None else NullProgress()


def _rows(entry: dict) -> str:
    tables = entry.get("tables") or {}
    if not tables:
        return ""
    return ", ".join(f"{t}={p.get('rows', '?')}" for t, p in tables.items())


def print_summary(manifest: dict, console: Any = None) -> None:
    """The run's stages as a table: status, rows, seconds and the paths of their tables."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    out = (manifest.get("config") or {}).get("output") or ""
    table = Table(title=f"run {manifest['run_id']} — {manifest['status']}")
    for col in ("stage", "status", "rows", "seconds", "tables"):
        table.add_column(col)
    order = manifest.get("stage_order") or list(manifest["stages"])
    for name in order:
        st = manifest["stages"][name]
        status = st["status"]
        if status == "skipped" and st.get("reason"):
            status = f"skipped ({st['reason']})"
        if status == "failed" and st.get("error"):
            status = f"failed: {st['error'][:120]}"
        paths = "\n".join(f"{out.rstrip('/')}/{t}/{p.get('version', '')}" for t, p in (st.get("tables") or {}).items())
        secs = st.get("seconds")
        table.add_row(name, status, _rows(st), "" if secs is None else f"{secs:.1f}", paths)
    console.print(table)


class _JsonFileHandler(logging.FileHandler):
    """A JSON-lines file handler whose format cannot be replaced: ``ray.init`` re-formats the
    handlers of the "ray" logger with its own plain-text formatter."""

    def __init__(self, path: str):
        super().__init__(path, encoding="utf-8")
        from atlas.logs import JsonFormatter

        self.formatter = JsonFormatter()

    def setFormatter(self, fmt: logging.Formatter | None) -> None:  # noqa: N802 - logging's name
        pass


def route_ray_logs(log_file: str | None) -> None:
    """Keep Ray's own log lines off the terminal: with a log file they go there (as JSON
    lines, like ours); without one only Ray's warnings reach the terminal. Ray Data's progress
    bars are off (ours replace them)."""
    import ray.data

    handlers: list[logging.Handler] = []
    if log_file:
        handlers.append(_JsonFileHandler(log_file))
    else:
        sh = logging.StreamHandler()
        sh.setLevel(logging.WARNING)
        handlers.append(sh)
    for name in RAY_LOGGERS:
        lg = logging.getLogger(name)
        for h in list(lg.handlers):
            lg.removeHandler(h)
        for h in handlers:
            lg.addHandler(h)
        lg.propagate = False
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    if hasattr(ctx, "print_on_execution_start"):
        ctx.print_on_execution_start = False


def elapsed(t0: float) -> float:
    return round(time.perf_counter() - t0, 2)
