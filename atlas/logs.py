"""Structured logs: JSON lines to a file (one object per event, extra fields kept) and a
human-readable console via rich."""

from __future__ import annotations

import json
import logging
import os
import time

_STD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _STD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(log_file: str | None = None, level: str = "INFO", console_level: str | None = None) -> None:
    """Console (rich) for people, optional JSON-lines file for machines. ``console_level``
    raises the console's threshold (``atlas run`` shows stage progress itself)."""
    from rich.logging import RichHandler

    root = logging.getLogger("atlas")
    root.setLevel(level)
    root.handlers.clear()
    root.propagate = False
    rh = RichHandler(show_path=False, rich_tracebacks=False, markup=False)
    if console_level:
        rh.setLevel(console_level)
    root.addHandler(rh)
    if log_file:
        os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
        fh = logging.FileHandler(log_file, encoding="utf-8")
        fh.setFormatter(JsonFormatter())
        root.addHandler(fh)
